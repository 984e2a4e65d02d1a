"""`make bench`'s runner: where its work folders go."""

from __future__ import annotations

import pytest

from benchmarks.run import main, work_parent


def test_a_missing_bench_folder_is_created_and_an_impossible_one_refused(tmp_path, monkeypatch, capsys):
    wanted = tmp_path / "bench" / "s1"
    assert work_parent(str(wanted)) == str(wanted) and wanted.is_dir()
    assert work_parent(None) is None and work_parent("") is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be created .*unset it to use the temp folder"):
        work_parent(str(blocker / "under"))
    monkeypatch.setenv("TXNLAKE_BENCH_DIR", str(blocker / "under"))
    assert main(["buffer"]) == 2  # refused before any benchmark starts
    assert "TXNLAKE_BENCH_DIR" in capsys.readouterr().err
