#!/usr/bin/env python
"""Send a few real chat requests to the mesh with the official openai client and print them."""

from __future__ import annotations

import argparse
import time

import openai

QUESTIONS = ["What is the capital of France?", "What is 2 + 2?",
             "Name a primary color."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm")
    parser.add_argument("--api-key", default="none", help="a tenant key when tenants are set")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    for q in QUESTIONS:
        t0 = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model=args.model, messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=40)
        resp = raw.parse()
        print(f"Q: {q}\nA: {resp.choices[0].message.content.strip()}\n"
              f"   [{raw.headers.get('x-mesh-variant')}, {resp.usage.completion_tokens} tokens, "
              f"{time.monotonic() - t0:.2f} s]\n", flush=True)

    q = "Write one sentence about Paris."
    print(f"Q (streamed): {q}\nA: ", end="", flush=True)
    for chunk in client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=60, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print("\n")


if __name__ == "__main__":
    main()
