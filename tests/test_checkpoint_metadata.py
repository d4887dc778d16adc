"""jscenegen/checkpoint/metadata.py: training_metadata.json fields and credential redaction."""
import subprocess
from pathlib import Path

import jax
import pytest

from jscenegen.checkpoint.metadata import REDACTED, git_commit, is_credential_name, redact, training_metadata


@pytest.mark.parametrize("name", ["api_key", "OPENAI_API_KEY", "hf_token", "HF_TOKEN", "apiKey",
                                  "clientSecret", "db_password", "access_token", "auth",
                                  "aws_secret_access_key", "judge.key"])
def test_credential_names(name):
    assert is_credential_name(name)


@pytest.mark.parametrize("name", ["max_new_tokens", "tokenizer", "trained_tokens", "keep_last",
                                  "monkey", "model", "base_url", "author", "protocol_hash"])
def test_ordinary_names(name):
    assert not is_credential_name(name)


def test_redact_keys_lists_and_environment_values(monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-0123456789")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to be matched inside strings
    data = {"judge": {"api_key": "anything", "urls": ["https://x/?k=sk-0123456789", "https://y"],
                      "tokens": {"max_new_tokens": 5}}, "note": "abc", "pair": (1, 2)}
    assert redact(data) == {"judge": {"api_key": REDACTED, "urls": [REDACTED, "https://y"],
                                      "tokens": {"max_new_tokens": 5}},
                            "note": "abc", "pair": [1, 2]}


def test_training_metadata_fields():
    meta = training_metadata(config={"a": {"b": 1}}, protocol_hash="ph", schedule_hash="sh",
                             optimizer_step=4, effective_updates=3,
                             judge={"kind": "rule", "name": "reachability-v1"},
                             extra={"source": "verl:global_step_100"})
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                          capture_output=True, text=True).stdout.strip()
    assert meta["git_commit"].split("-")[0] == head == git_commit().split("-")[0]
    assert (meta["protocol_hash"], meta["schedule_hash"]) == ("ph", "sh")
    assert (meta["optimizer_step"], meta["effective_updates"]) == (4, 3)
    assert meta["judge"] == {"kind": "rule", "name": "reachability-v1"}
    assert meta["config"] == {"a": {"b": 1}} and meta["source"] == "verl:global_step_100"
    assert meta["versions"]["jax"] == jax.__version__ and meta["versions"]["python"]
    assert meta["created_utc"].endswith("+00:00")
    with pytest.raises(ValueError, match="'git_commit'"):
        training_metadata(config={}, protocol_hash="", schedule_hash="", optimizer_step=0,
                          effective_updates=0, judge=None, extra={"git_commit": "x"})
    with pytest.raises(ValueError, match="must be >= 0"):
        training_metadata(config={}, protocol_hash="", schedule_hash="", optimizer_step=-1,
                          effective_updates=0, judge=None)


def test_git_commit_outside_a_checkout(tmp_path):
    assert git_commit(tmp_path) is None
