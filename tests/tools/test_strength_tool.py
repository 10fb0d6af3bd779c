"""tools/test_strength.py names a test whose checks fell between two revisions, across a rename."""

from __future__ import annotations

import subprocess
import sys

from launchers import ROOT

TOOL = str(ROOT / "tools" / "test_strength.py")


def commit(repo, files: dict, message: str) -> None:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], cwd=repo, check=True)


def strength(repo, before: str, after: str):
    return subprocess.run([sys.executable, TOOL, before, after], cwd=repo, capture_output=True, text=True, timeout=60)


def test_a_moved_test_keeps_its_checks_and_a_dropped_assert_is_named(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    commit(tmp_path, {"tests/test_a.py": "def test_x():\n    assert 1\n    assert 2\n\n"
                                         "def test_y():\n    import pytest\n    with pytest.raises(ValueError):\n"
                                         "        int('a')\n"}, "first")
    (tmp_path / "tests" / "test_a.py").rename(tmp_path / "tests" / "test_b.py")
    commit(tmp_path, {}, "moved")
    moved = strength(tmp_path, "HEAD~1", "HEAD")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert "test functions: 2 -> 2; checks: 3 -> 3" in moved.stdout, moved.stdout

    commit(tmp_path, {"tests/test_b.py": "def test_x():\n    assert 1\n"}, "weakened")
    weakened = strength(tmp_path, "HEAD~1", "HEAD")
    assert weakened.returncode == 1, weakened.stdout + weakened.stderr
    assert "fewer checks: test_x 2 -> 1" in weakened.stdout, weakened.stdout
    assert "test gone: test_y" in weakened.stdout, weakened.stdout
