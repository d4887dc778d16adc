"""What a refused CLI command leaves on stderr: one `error: ...` line, no traceback."""
from __future__ import annotations


def one_error_line(capsys) -> str:
    """The refusal's single stderr line (asserted: starts with `error: `, one line, no
    traceback); capsys is pytest's fixture."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err
