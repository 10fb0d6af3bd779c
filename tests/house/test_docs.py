"""The Sphinx docs build with warnings as errors, and cover the API and every smdistributed name."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from launchers import ROOT, run

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None,
    reason="sphinx and myst-parser are not installed: pip install -e '.[dev]' to build the docs",
)


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs-html")
    doctrees = tmp_path_factory.mktemp("doctrees")
    res = run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d", str(doctrees),
               str(ROOT / "docs"), str(out)], timeout=300)
    assert res.returncode == 0, f"the docs build failed or warned:\n{res.stderr}\n{res.stdout}"
    return out


def _text(path) -> str:
    return re.sub(r"<[^>]+>", "", path.read_text())


def test_builds_without_warnings(html):
    for page in ("index", "quickstart", "migrating", "api", "tools", "performance"):
        assert (html / f"{page}.html").exists(), page


def test_api_reference_covers_the_public_api(html):
    import smddp.torch.distributed as dist

    text = _text(html / "api.html")
    for name in dist.__all__:
        assert f"smddp.torch.distributed.{name}" in text, name
    for name in ("DistributedDataParallel", "SMDDPError", "CollectiveTimeout", "NotInitializedError"):
        assert name in text, name
    assert "Raises" in text


def test_migration_table_names_every_v1_function(html):
    text = _text(html / "migrating.html")
    for name in ("is_available", "init_process_group", "is_initialized", "get_world_size", "get_rank",
                 "get_local_rank", "all_reduce", "broadcast", "all_gather", "all_to_all_single", "barrier",
                 "ReduceOp", "group.WORLD", "DistributedDataParallel", "no_sync", "torch_smddp", "smddprun"):
        assert name in text, name


def test_contributed_pages_are_listed_when_present(html):
    index = (html / "index.html").read_text()
    for page in ("launching", "backends", "ddp", "fsdp", "sagemaker", "troubleshooting"):
        if (ROOT / "docs" / f"{page}.md").exists():
            assert f'href="{page}.html"' in index, page
