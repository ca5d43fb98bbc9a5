"""Model and adapter references read offline (serve_app/common/sources.py)."""

from __future__ import annotations

import pytest

from serve_app.common.paths import model_identity
from serve_app.common.sources import BUCKET, HUB, LOCAL, SourceError, parse_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("ref, revision, kind, location", [
    ("smollm2-135m-instruct", None, LOCAL, "smollm2-135m-instruct"),
    ("/srv/models/llama", None, LOCAL, "/srv/models/llama"),
    ("./models/llama", None, LOCAL, "./models/llama"),
    ("file:///srv/models/llama", None, LOCAL, "/srv/models/llama"),
    ("meta-llama/Llama-3.1-8B-Instruct", COMMIT, HUB, "meta-llama/Llama-3.1-8B-Instruct"),
    ("hf://meta-llama/Llama-3.1-8B-Instruct", COMMIT, HUB, "meta-llama/Llama-3.1-8B-Instruct"),
    ("s3://models/llama-3.1-8b/", None, BUCKET, "s3://models/llama-3.1-8b"),
    ("gs://my.models/team/llama", None, BUCKET, "gs://my.models/team/llama"),
])
def test_each_kind_of_source(ref, revision, kind, location):
    source = parse_source(ref, revision)
    assert (source.kind, source.location, source.revision) == (kind, location, revision)
    assert source.remote == (kind != LOCAL)


@pytest.mark.parametrize("ref, revision, match", [
    ("meta-llama/Llama-3.1-8B-Instruct", None, "no revision: pin the commit"),
    ("meta-llama/Llama-3.1-8B-Instruct", "main", "'main' is not pinned"),
    ("meta-llama/Llama-3.1-8B-Instruct", COMMIT[:12], "is not pinned"),
    ("meta--llama/x", COMMIT, "is not a Hugging Face model id"),
    ("a/b/c", COMMIT, "is not a Hugging Face model id"),
    ("s3://models", None, "name the folder inside the bucket"),
    ("s3://Models/x", None, "'Models' is not a bucket name"),
    ("s3://models/x?versionId=1", None, "no query or fragment"),
    ("az://container/x", None, "scheme 'az://' is not supported"),
    ("file://host/x", None, "must be absolute"),
    ("s3://models/x", COMMIT, "'revision' pins a Hugging Face id only"),
    ("smollm2-135m-instruct", COMMIT, "'revision' pins a Hugging Face id only"),
])
def test_what_validate_refuses_offline(ref, revision, match):
    with pytest.raises(SourceError, match=match):
        parse_source(ref, revision)


def test_one_model_whatever_its_source():
    """An adapter's base_model and a variant's model match by the last part of the path."""
    names = ["smollm2-135m-instruct", "/srv/models/smollm2-135m-instruct/",
             "mesh-test/smollm2-135m-instruct", "hf://mesh-test/smollm2-135m-instruct",
             "s3://models/team/smollm2-135m-instruct/", "gs://m/smollm2-135m-instruct"]
    assert {model_identity(n) for n in names} == {"smollm2-135m-instruct"}
