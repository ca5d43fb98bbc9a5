"""Credentials out of messages and log lines (serve_app/common/redaction.py)."""

from __future__ import annotations

import logging

import pytest

from serve_app.common.redaction import MASK, redact, redacting_logger


@pytest.mark.parametrize("text, want", [
    ("'AKIAEXAMPLE:wJalrSECRETKEY@my-bucket' is not a bucket name",  # a netloc, quoted
     f"'{MASK}@my-bucket' is not a bucket name"),
    ("could not list s3://AKIAEXAMPLE:wJalrSECRETKEY@my-bucket/llama: 403",
     f"could not list s3://{MASK}@my-bucket/llama: 403"),
    ("GET https://user:pass@host:8443/x failed", f"GET https://{MASK}@host:8443/x failed"),
    ("hf://hf_SECRETTOKEN@org/name", f"hf://{MASK}@org/name"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F2026&"
     "X-Amz-Signature=abc123&versionId=7",
     f"https://b.s3.amazonaws.com/k?X-Amz-Algorithm={MASK}&X-Amz-Credential={MASK}&"
     f"X-Amz-Signature={MASK}&versionId=7"),
    ("https://storage.googleapis.com/b/k?X-Goog-Signature=deadbeef",
     f"https://storage.googleapis.com/b/k?X-Goog-Signature={MASK}"),
    ("https://a.blob.core.windows.net/c/k?sv=2022-11-02&sig=SeCrEt%3D 'next'",
     f"https://a.blob.core.windows.net/c/k?sv=2022-11-02&sig={MASK} 'next'"),
    ("http://h/x?api_key=k1&access_token=t1&page=2",
     f"http://h/x?api_key={MASK}&access_token={MASK}&page=2"),
    # what must stay: hub ids at a revision, adapter keys, file URIs, plain paths
    ("hf://org/name@0123abcd adapter acme@v1 file:///srv/x@y /a/b@c at 12:30 a@b "
     "adapters[0]: acme@v1",
     "hf://org/name@0123abcd adapter acme@v1 file:///srv/x@y /a/b@c at 12:30 a@b "
     "adapters[0]: acme@v1"),
])
def test_redact(text, want):
    assert redact(text) == want
    assert redact(want) == want  # idempotent


def test_a_log_line_is_redacted_before_any_handler_sees_it(caplog):
    logger = redacting_logger(logging.getLogger("tests.redaction"))
    redacting_logger(logger)  # added once
    assert len(logger.filters) == 1
    with caplog.at_level(logging.INFO, logger="tests.redaction"):
        logger.info("fetching %s (%d)", "s3://AKIAEXAMPLE:wJalrSECRETKEY@b/x?sig=SIG", 3)
    [record] = caplog.records
    assert record.getMessage() == f"fetching s3://{MASK}@b/x?sig={MASK} (3)"
    assert "SECRET" not in caplog.text and "SIG" not in caplog.text.replace("sig=", "")
