#!/usr/bin/env python
"""Send a few real chat requests to the mesh with the official openai client and print them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.script_args import ScriptError, run, script_parser  # noqa: E402

QUESTIONS = ["What is the capital of France?", "What is 2 + 2?",
             "Name a primary color."]


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the mesh's OpenAI base URL")
    parser.add_argument("--model", default="smollm", help="the route (or route:adapter)")
    parser.add_argument("--api-key", default="none", help="a tenant key when tenants are set")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    try:
        ask(client, args.model)
    except openai.APIConnectionError as e:
        raise ScriptError(f"the mesh does not answer at {args.base_url} ({e}); start it with "
                          "./scripts/demo.sh, or pass its address with --base-url") from None
    except openai.APIStatusError as e:
        raise ScriptError(f"the mesh answered {e.status_code}: {e.message}") from None


def ask(client: openai.OpenAI, model: str) -> None:
    """The demo's questions, then one streamed answer."""

    for q in QUESTIONS:
        t0 = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=40)
        resp = raw.parse()
        print(f"Q: {q}\nA: {resp.choices[0].message.content.strip()}\n"
              f"   [{raw.headers.get('x-mesh-variant')}, {resp.usage.completion_tokens} tokens, "
              f"{time.monotonic() - t0:.2f} s]\n", flush=True)

    q = "Write one sentence about Paris."
    print(f"Q (streamed): {q}\nA: ", end="", flush=True)
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=60, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print("\n")


if __name__ == "__main__":
    run(main)
