"""jscenegen/checkpoint/metadata.py: training_metadata.json fields and credential redaction."""
import subprocess
from pathlib import Path

import jax
import pytest

from jscenegen.checkpoint.metadata import (
    REDACTED,
    git_commit,
    is_credential_name,
    mask_credentials,
    redact,
    redact_argv,
    training_metadata,
)


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


def test_urls_with_credentials_are_redacted_without_any_environment_variable():
    data = {"judge": {"base_url": "https://user:sk-abc@judge.example/v1",
                      "proxy": "http://TOKEN123@proxy:8080", "mirror": "https://h/v1?api_key=x&n=1",
                      "plain": "https://judge.example/v1?model=q&n=2", "path": "data/x://y"}}
    assert redact(data) == {"judge": {"base_url": REDACTED, "proxy": REDACTED, "mirror": REDACTED,
                                      "plain": "https://judge.example/v1?model=q&n=2",
                                      "path": "data/x://y"}}


def test_redact_argv_keeps_keys_and_reports_what_it_removed(monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-env-0123456789")
    argv = ["jscenegen", "train", "--run-dir", "r", "judge.base_url=https://u:pw-1@h/v1",
            "judge.api_key=hunter22", "--token=abc", "https://t0k@h/x", "optim.lr=1e-5",
            "note=sk-env-0123456789"]
    out, removed = redact_argv(argv)
    assert out == ["jscenegen", "train", "--run-dir", "r", f"judge.base_url={REDACTED}",
                   f"judge.api_key={REDACTED}", f"--token={REDACTED}", REDACTED, "optim.lr=1e-5",
                   f"note={REDACTED}"]
    assert set(removed) == {"https://u:pw-1@h/v1", "hunter22", "abc", "https://t0k@h/x",
                            "sk-env-0123456789"}


def test_redact_argv_reads_an_override_as_its_yaml_value():
    """A credential inside a mapping value or a quoted URL was kept (only the raw text was
    checked): it reached error lines and the argv recorded for the run."""
    argv = ["judge={api_key: sk-abc123}", 'judge={base_url: "https://u:hunter2@h/v1"}',
            'judge.base_url="https://u:hunter2@h/v1"', "judge={model: q, timeout_s: 5}"]
    out, removed = redact_argv(argv)
    assert out == [f"judge={REDACTED}"] * 2 + [f"judge.base_url={REDACTED}",
                                               "judge={model: q, timeout_s: 5}"]
    assert "sk-abc123" in removed and "https://u:hunter2@h/v1" in removed
    assert '"https://u:hunter2@h/v1"' in removed and "{api_key: sk-abc123}" in removed
    out, removed = redact_argv(["judge={token: 1}"])
    assert out == [f"judge={REDACTED}"] and removed == ["{token: 1}"]   # not every "1"
    # a mapping YAML refuses (a key given twice) is still read for credential names
    out, removed = redact_argv(["judge={api_key: sk-abc12345, api_key: x}",
                                "sampling={top_k: 1, top_k: 2}"])
    assert out == [f"judge={REDACTED}", "sampling={top_k: 1, top_k: 2}"]
    assert removed == ["{api_key: sk-abc12345, api_key: x}"]


def test_a_credential_in_a_refused_override_never_reaches_the_error_line(capsys):
    from jscenegen.cli import main

    rc = main(["train", "judge={api_key: sk-abc123}", "logging.swanlab_mode=disabled"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown key 'judge.api_key'" in err and "sk-abc123" not in err, err


def test_mask_credentials_keeps_lengths_in_every_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "meta.json").write_text('{"command": "train judge.base_url=https://u:pw-1@h"}')
    (tmp_path / "log.bin").write_bytes(b"\x00\x17https://u:pw-1@h\x01")
    (tmp_path / "clean.txt").write_text("nothing here")
    changed = mask_credentials(tmp_path, ["https://u:pw-1@h"])
    assert sorted(p.name for p in changed) == ["log.bin", "meta.json"]
    assert (tmp_path / "log.bin").read_bytes() == b"\x00\x17" + b"*" * 16 + b"\x01"
    assert "pw-1" not in (tmp_path / "a" / "meta.json").read_text()


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


@pytest.mark.parametrize("state, why", [
    ({"step": -4}, r"step: Input should be greater than or equal to 0"),
    ({"step": 2.9}, r"step: Input should be a valid integer"),
    ({"step": 10 ** 30}, r"step: Input should be less than 2147483648"),
    ({"step": "abc"}, r"step: Input should be a valid integer"),
    ({"step": 3, "lr_schedule_count": None, "optimizer_step": "x"}, r"optimizer_step: Input should be"),
])
def test_a_converted_position_names_the_count_it_cannot_use(state, why):
    """-4 and 2.9 were taken (step -4, step 2), 10**30 overflowed the int32 counter later, and
    a bad count said "no usable invalid literal for int()" without its key. A resume's check
    of a step directory names the item's path (it said "train_state: ..." alone)."""
    from jscenegen.checkpoint.resume import check_step_number, checkpoint_position
    from jscenegen.checkpoint.store import CheckpointError

    with pytest.raises(CheckpointError, match=rf"^train_state: {why}"):
        checkpoint_position(state)
    with pytest.raises(CheckpointError, match=rf"^/runs/r/checkpoints/3/train_state: {why}"):
        check_step_number(Path("/runs/r/checkpoints/3"), 3, state)


def test_a_converted_position_reads_its_counts():
    from jscenegen.checkpoint.resume import checkpoint_position

    at = checkpoint_position({"step": 5, "lr_schedule_count": 5, "optimizer_step": 4})
    assert (at.step, at.lr_step, at.skipped_steps) == (5, 5, 1)
    at = checkpoint_position({"step": 5, "lr_schedule_count": None})
    assert (at.step, at.lr_step, at.skipped_steps) == (5, 5, 0)


@pytest.mark.parametrize("state,key", [
    ({"step": 8, "lr_schedule_count": 8}, "step"),
    ({"schedule": {"attempts": 8}, "lr_step": 8, "skipped_steps": 0, "num_scenes": 1,
      "schedule_hash": "s", "protocol_hash": "p", "reward": {}}, "schedule.attempts")])
def test_a_step_directory_numbered_otherwise_than_its_train_state_is_refused(tmp_path, state, key):
    """`cp -r checkpoints/8 checkpoints/12` resumed step 12 at attempt 8, and the run's next save
    failed far from the cause."""
    from jscenegen.checkpoint.resume import check_step_number
    from jscenegen.checkpoint.store import CheckpointError

    def ck(step):
        return tmp_path / "checkpoints" / str(step), step, state

    assert check_step_number(*ck(8)).step == 8
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'checkpoints' / '12'}: a step "
                                              rf"directory numbered 12 whose train_state {key} is "
                                              r"8; a step keeps the number it was saved under \(was "
                                              r"it copied or renamed\?\): name it 8, or remove it$"):
        check_step_number(*ck(12))
