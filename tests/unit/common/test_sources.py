"""Model and adapter references read offline (serve_app/common/sources.py)."""

from __future__ import annotations

import pytest

from serve_app.common.paths import model_identity
from serve_app.common.sources import (BUCKET, HUB, LOCAL, SourceError, model_key,
                                      parse_file_source, parse_source, source_problem)

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


def test_one_short_name_whatever_its_source():
    """The short name (labels, names of derived models) is the last part of the path."""
    names = ["smollm2-135m-instruct", "/srv/models/smollm2-135m-instruct/",
             "mesh-test/smollm2-135m-instruct", "hf://mesh-test/smollm2-135m-instruct",
             "s3://models/team/smollm2-135m-instruct/", "gs://m/smollm2-135m-instruct"]
    assert {model_identity(n) for n in names} == {"smollm2-135m-instruct"}


def test_a_model_is_its_full_id_and_revision():
    """What adapters are matched by: a hub id at its commit, a bucket folder, a local
    folder's name (a node names a local model by any path to it)."""
    other = "f" * 40
    assert {model_key(n) for n in ["smollm2-135m-instruct", "/srv/models/smollm2-135m-instruct/",
                                   "./models/smollm2-135m-instruct",
                                   "file:///srv/models/smollm2-135m-instruct"]} == {
        "smollm2-135m-instruct"}
    keys = [model_key("meta-llama/Llama-3.1-8B-Instruct", COMMIT),
            model_key("hf://meta-llama/Llama-3.1-8B-Instruct", COMMIT)]
    assert keys == [f"hf://meta-llama/Llama-3.1-8B-Instruct@{COMMIT}"] * 2
    different = [model_key("other-org/Llama-3.1-8B-Instruct", COMMIT),
                 model_key("meta-llama/Llama-3.1-8B-Instruct", other),
                 model_key("s3://models/Llama-3.1-8B-Instruct"),
                 model_key("gs://models/Llama-3.1-8B-Instruct"),
                 model_key("Llama-3.1-8B-Instruct")]
    assert len({keys[0], *different}) == 6
    assert model_key("s3://models/team/llama/") == "s3://models/team/llama"


#: URIs that would climb out of the node's cache (the issue's, and their encoded forms).
CLIMBING = [
    ("s3://models/../../../../tmp/victim", "a path part '..'"),
    ("gs://models/a/../../../etc", "a path part '..'"),
    ("s3://models/./llama", "a path part '.'"),
    ("s3://models/llama//weights", "an empty path part"),
    ("s3://models/%2e%2e/%2e%2e/home", "'%2e%2e' (percent-encoded '..')"),
    ("s3://models/x/%2E", "'%2E' (percent-encoded '.')"),
    ("s3://models/a%2F..%2F..%2Fetc", "holds a path separator once percent-decoded"),
    ("gs://models/a%5c..", "holds a path separator once percent-decoded"),
    ("s3://models/a%00b", "holds a control character"),
    ("hf://meta-llama/..", "a path part '..'"),
    ("hf://../../home", "a path part '..'"),
    ("meta-llama/%2e%2e", "'%2e%2e' (percent-encoded '..')"),
]


@pytest.mark.parametrize("ref, why", CLIMBING)
def test_no_source_climbs_out_of_the_cache(ref, why):
    revision = COMMIT if not ref.startswith(("s3", "gs")) else None
    problem = source_problem(ref, revision)
    assert problem is not None and why in problem, problem


@pytest.mark.parametrize("ref", [
    "s3://models/../../../../tmp/victim.yaml", "gs://models/a/%2e%2e/%2e%2e/m.yaml",
    "s3://models//m.yaml", f"hf://acme/registry@{COMMIT}/../../m.yaml",
    f"hf://acme/..@{COMMIT}/m.yaml", f"hf://acme/registry@{COMMIT}/a%2F..%2Fm.yaml"])
def test_no_file_reference_climbs_out_of_the_cache(ref):
    with pytest.raises(SourceError, match=r"path part|separator"):
        parse_file_source(ref)


SECRETS = ["wJalrSECRETKEY", "hf_SECRETTOKEN", "SECRETSIGNATURE", "SECRETSIG", "AKIAEXAMPLE"]


@pytest.mark.parametrize("ref", [
    "s3://AKIAEXAMPLE:wJalrSECRETKEY@my-bucket/llama",
    "gs://AKIAEXAMPLE:wJalrSECRETKEY@my-bucket/llama",
    "hf://hf_SECRETTOKEN@meta-llama/Llama-3.1-8B-Instruct",
    "s3://my-bucket/llama?X-Amz-Signature=SECRETSIGNATURE&X-Amz-Credential=AKIAEXAMPLE",
    "https://my-bucket.s3.amazonaws.com/llama?X-Amz-Signature=SECRETSIGNATURE",
    "https://acct.blob.core.windows.net/c/llama?sv=2022&sig=SECRETSIG",
    "file://AKIAEXAMPLE:wJalrSECRETKEY@host/llama",
])
def test_a_credential_in_a_uri_is_refused_and_never_echoed(ref):
    for parse in (lambda: parse_source(ref), lambda: parse_file_source(ref)):
        with pytest.raises(SourceError) as refusal:
            parse()
        message = str(refusal.value)
        assert "***" in message and not any(s in message for s in SECRETS), message
    if "@" in ref.partition("://")[2].partition("/")[0]:
        assert "a URI carries no credentials" in source_problem(ref)


@pytest.mark.parametrize("ref, kind, location, path, revision", [
    ("adapters/manifest.yaml", LOCAL, "adapters/manifest.yaml", "", None),
    ("file:///srv/registry/manifest.yaml", LOCAL, "/srv/registry/manifest.yaml", "", None),
    ("s3://acme-adapters/registry/manifest.yaml", BUCKET, "s3://acme-adapters",
     "registry/manifest.yaml", None),
    ("gs://acme-adapters/manifest.yaml", BUCKET, "gs://acme-adapters", "manifest.yaml", None),
    (f"hf://acme/registry@{COMMIT}/manifest.yaml", HUB, "acme/registry", "manifest.yaml",
     COMMIT),
])
def test_a_file_from_each_kind_of_source(ref, kind, location, path, revision):
    f = parse_file_source(ref)
    assert (f.kind, f.location, f.path, f.revision) == (kind, location, path, revision)


@pytest.mark.parametrize("ref, match", [
    ("hf://acme/registry/manifest.yaml", "hf://org/name@<40-hex commit>/path/in/repo"),
    ("hf://acme/registry@main/manifest.yaml", "pinned to the commit"),
    (f"hf://acme/registry@{COMMIT}", "name the file in the repo after the commit"),
    ("s3://acme-adapters", "name the folder inside the bucket"),
    ("az://c/manifest.yaml", "scheme 'az://' is not supported"),
])
def test_what_a_file_reference_refuses(ref, match):
    with pytest.raises(SourceError, match=match):
        parse_file_source(ref)
