"""smddp-bench: the pure helpers, the checker, and real runs under mpirun, torchrun and plain python."""

from __future__ import annotations

import csv
import io

import pytest
import torch

from smddp import bench

from launchers import ROOT, mpirun, python, torchrun, untagged

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- sizes
@pytest.mark.unit
@pytest.mark.parametrize("text, expected", [
    ("1", 1), ("1024", 1024), ("1K", 1024), ("1k", 1024), ("64M", 64 << 20), ("1G", 1 << 30),
    ("2T", 2 << 40), ("1KB", 1024), ("1KiB", 1024), ("1.5K", 1536), ("0.5M", 512 << 10), (" 8M ", 8 << 20),
])
def test_parse_size(text, expected):
    assert bench.parse_size(text) == expected


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", "K", "abc", "-1K", "1X", "1.3", "1.0001K", "1 K B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        bench.parse_size(text)


@pytest.mark.unit
@pytest.mark.parametrize("nbytes, text", [(100, "100"), (1024, "1K"), (1536, "1.5K"), (64 << 20, "64M"),
                                          (1 << 30, "1G")])
def test_format_size(nbytes, text):
    assert bench.format_size(nbytes) == text
    assert bench.parse_size(text) == nbytes


@pytest.mark.unit
def test_sweep_by_factor_and_by_bytes():
    sizes = bench.sweep(1024, 64 << 20, 2)
    assert sizes[0] == 1024 and sizes[-1] == 64 << 20 and len(sizes) == 17
    assert bench.sweep(1024, 5000, 4) == [1024, 4096]
    assert bench.sweep(1 << 20, 4 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20, 4 << 20]
    with pytest.raises(ValueError):
        bench.sweep(2048, 1024)
    with pytest.raises(ValueError):
        bench.sweep(1024, 2048, 1, 0)


@pytest.mark.unit
def test_shape_rounds_like_nccl_tests():
    assert bench.shape("all_reduce", 1024, 4, 2) == (256, 1024)
    assert bench.shape("broadcast", 1023, 4, 2) == (255, 1020)
    assert bench.shape("all_gather", 1024, 4, 3) == (85, 1020)  # count is per rank
    assert bench.shape("all_to_all", 1024, 4, 2) == (128, 1024)  # count is per peer
    assert bench.shape("all_reduce", 1, 8, 2) == (1, 8)  # at least one element
    assert bench.shape("all_gather", 1, 4, 4) == (1, 16)


# ---------------------------------------------------------------------------- busbw factors
@pytest.mark.unit
@pytest.mark.parametrize("n, all_reduce, gather", [(1, 0.0, 0.0), (2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_bus_factors(n, all_reduce, gather):
    assert bench.bus_factor("all_reduce", n) == pytest.approx(all_reduce)
    assert bench.bus_factor("all_gather", n) == pytest.approx(gather)
    assert bench.bus_factor("all_to_all", n) == pytest.approx(gather)
    assert bench.bus_factor("broadcast", n) == 1.0


@pytest.mark.unit
def test_bus_factor_rejects():
    with pytest.raises(ValueError):
        bench.bus_factor("reduce_scatter", 2)
    with pytest.raises(ValueError):
        bench.bus_factor("all_reduce", 0)


@pytest.mark.unit
def test_dtype_and_choice_parsing():
    assert bench.dtype_names("float32,fp32,float") == ["float"]
    assert bench.dtype_names("all") == ["int8", "uint8", "int32", "int64", "half", "bfloat16", "float", "double"]
    assert bench.dtype_names("bf16,half") == ["bfloat16", "half"]
    with pytest.raises(ValueError, match="valid"):
        bench.dtype_names("complex64")


# ---------------------------------------------------------------------------- expectations
@pytest.mark.unit
def test_expected_values_from_patterns():
    p = [bench.pattern(r, 0, 26) for r in range(3)]
    assert int(p[0].min()) == 1 and int(p[0].max()) == 13
    assert torch.equal(bench.expected("all_reduce", 1, 3, 26, torch.float32),
                       (p[0] + p[1] + p[2]).float())
    assert torch.equal(bench.expected("all_reduce", 0, 3, 26, torch.int32, "max"),
                       torch.maximum(torch.maximum(p[0], p[1]), p[2]).int())
    assert torch.equal(bench.expected("all_reduce", 0, 3, 26, torch.int64, "avg"),
                       torch.div(p[0] + p[1] + p[2], 3, rounding_mode="trunc"))
    assert torch.equal(bench.expected("broadcast", 0, 3, 26, torch.float64, root=2), p[2].double())
    gathered = bench.expected("all_gather", 1, 3, 26, torch.int64)
    assert torch.equal(gathered, torch.cat(p))
    # all_to_all: rank 1 receives chunk 1 (elements 4..8 of 12) of every rank's input.
    got = bench.expected("all_to_all", 1, 3, 4, torch.int64)
    assert torch.equal(got, torch.cat([bench.pattern(r, 0, 12)[4:8] for r in range(3)]))


@pytest.mark.unit
def test_expected_int8_sum_wraps_like_the_transport():
    want = bench.expected("all_reduce", 0, 12, 13, torch.int8)
    total = sum(bench.pattern(r, 0, 13) for r in range(12))
    assert torch.equal(want, total.to(torch.int8))


@pytest.mark.unit
def test_count_wrong():
    want = torch.arange(1, 11, dtype=torch.float32)
    assert bench.count_wrong(want.clone(), want, 2) == 0
    bad = want.clone()
    bad[3] += 1
    bad[7] = float("nan")
    assert bench.count_wrong(bad, want, 2) == 2
    ints = torch.arange(10)
    assert bench.count_wrong(ints + (ints == 5), ints, 2) == 1


class _Broken(bench.Impl):
    """An implementation that gets every all_reduce wrong: the checker must see it."""

    name = backend = api = "broken"

    def all_reduce(self, tensor, redop):
        tensor.add_(1)

    def barrier(self):
        pass


@pytest.mark.unit
def test_runner_counts_wrong_elements():
    runner = bench.Runner(_Broken(), torch.device("cpu"), 0, 1)
    row = runner.measure("all_reduce", 4096, "float", "sum", 0, warmup=1, iters=2, check=True)
    assert row.wrong == 1024 and row.count == 1024 and row.size_bytes == 4096
    assert row.time_us > 0 and row.algbw_gbps > 0 and row.busbw_gbps == 0.0  # one rank: no bus traffic
    line = bench.format_row(row)
    assert line.split()[:5] == ["4096", "1024", "float", "sum", "-1"] and line.split()[-1] == "1024"


@pytest.mark.unit
def test_csv_and_plot_writers(tmp_path):
    rows = [bench.Row("all_reduce", impl, "mpi", "smddp", "cpu", 2, size, size // 4, "float", "sum", -1,
                      10.0, size / 1e4, size / 1e4, 0)
            for impl in ("smddp", "torch-gloo") for size in (1024, 2048, 4096)]
    bench.write_csv(str(tmp_path / "b.csv"), rows)
    parsed = list(csv.DictReader(io.StringIO((tmp_path / "b.csv").read_text())))
    assert len(parsed) == 6 and tuple(parsed[0]) == bench.CSV_FIELDS
    assert float(parsed[2]["busbw_gbps"]) == pytest.approx(0.4096)
    pytest.importorskip("matplotlib")
    bench.write_plot(str(tmp_path / "b.png"), rows, title="unit")
    data = (tmp_path / "b.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


# ---------------------------------------------------------------------------- real runs
def _tables(stdout: str):
    """``{(op, impl, type, redop): [row fields]}`` from rank 0's output."""
    tables, current = {}, None
    for line in untagged(stdout).splitlines():
        if line.startswith("# Collective:"):
            words = line.split()
            fields = dict(zip(words[1::2], words[2::2]))
            current = (fields["Collective:"], fields["implementation:"], fields["type:"], fields.get("redop:"))
            assert current not in tables, current
            tables[current] = []
        elif line.strip() and not line.startswith("#") and current is not None:
            tables[current].append(line.split())
    return tables


@pytest.mark.mpi
def test_every_op_under_mpirun_checks_clean(tmp_path):
    out_csv, out_png = tmp_path / "bench.csv", tmp_path / "bench.png"
    res = mpirun(2, ["-m", "smddp.bench", "--op", "all", "-b", "1K", "-e", "256K", "-f", "4", "-n", "3", "-w", "1",
                     "--check", "--compare", "gloo", "--csv", str(out_csv), "--plot", str(out_png)],
                 timeout=180).check()
    tables = _tables(res.stdout)
    impls = ("smddp(mpi)", "torch-gloo(gloo)")
    assert {key[:2] for key in tables} == {(op, impl) for op in bench.OPS for impl in impls}
    tables = {key[:2]: rows for key, rows in tables.items()}
    for key, rows in tables.items():
        assert [int(r[0]) for r in rows] == [1024, 4096, 16384, 65536, 262144], key
        assert all(r[-1] == "0" for r in rows), (key, rows)
    assert "# Wrong values         : 0 OK" in res.stdout
    assert res.stdout.count("# smddp-bench") == 1  # rank 0 only
    assert "#  Rank  1 Pid" in res.stdout
    # broadcast's busbw equals its algbw; all_reduce's too on 2 ranks; gather's is half.
    for r in tables[("broadcast", "smddp(mpi)")] + tables[("all_reduce", "smddp(mpi)")]:
        assert r[6] == r[7]
    records = list(csv.DictReader(out_csv.open()))
    assert len(records) == sum(len(rows) for rows in tables.values())
    assert {r["wrong"] for r in records} == {"0"} and {r["world_size"] for r in records} == {"2"}
    for r in records:
        factor = bench.bus_factor(r["op"], 2)
        assert float(r["busbw_gbps"]) == pytest.approx(float(r["algbw_gbps"]) * factor)
        assert float(r["algbw_gbps"]) == pytest.approx(int(r["size_bytes"]) / float(r["time_us"]) / 1e3)
    data = out_png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


@pytest.mark.mpi
def test_every_dtype_and_redop_under_mpirun_3_ranks():
    res = mpirun(3, ["-m", "smddp.bench", "--op", "all", "-d", "all", "--redop", "all", "-b", "8", "-e", "512",
                     "-f", "8", "-n", "1", "-w", "0", "--root", "2", "--check", "--progress", "off"],
                 timeout=180).check()
    tables = _tables(res.stdout)
    rows = [r for table in tables.values() for r in table]
    assert len(rows) == (8 * 4 + 8 * 3) * 3
    assert all(r[-1] == "0" for r in rows), [r for r in rows if r[-1] != "0"]
    assert {r[2] for r in rows} == {"int8", "uint8", "int32", "int64", "half", "bfloat16", "float", "double"}
    assert {r[4] for r in rows if r[3] == "none" and r[4] != "-1"} == {"2"}  # broadcast root


def test_world_of_one_plain_python():
    res = python(["-m", "smddp.bench", "--op", "all", "-b", "1K", "-e", "4K", "-n", "2", "-w", "1", "--check"],
                 timeout=120).check()
    assert "nranks 1" in res.stdout and "backend: local" in res.stdout
    rows = [r for table in _tables(res.stdout).values() for r in table]
    assert len(rows) == 4 * 3 and all(r[-1] == "0" for r in rows)


def test_torchrun_through_torch_api():
    res = torchrun(2, ["-m", "smddp.bench", "--op", "all_reduce,broadcast", "-b", "1K", "-e", "4K", "-f", "4",
                       "-n", "2", "-w", "1", "--api", "torch", "--redop", "avg", "--check"], timeout=180).check()
    assert "launcher: torchrun" in res.stdout and "api: torch" in res.stdout
    rows = [r for table in _tables(res.stdout).values() for r in table]
    assert len(rows) == 4 and all(r[-1] == "0" for r in rows)


def test_bad_arguments_fail_before_launching_anything():
    res = python(["-m", "smddp.bench", "--op", "reduce"], timeout=60)
    assert res.returncode == 2 and "unknown op 'reduce'" in res.stderr
    res = python(["-m", "smddp.bench", "-b", "lots"], timeout=60)
    assert res.returncode == 2 and "not a size" in res.stderr


@pytest.mark.unit
def test_help_documents_every_option():
    text = bench.build_parser().format_help()
    for option in ("--op", "--minbytes", "--maxbytes", "--stepfactor", "--iters", "--warmup", "--dtype", "--backend",
                   "--check", "--csv", "--plot", "--compare", "--average", "--root", "--redop", "--api", "--device"):
        assert option in text


@pytest.mark.unit
@pytest.mark.parametrize("op", bench.OPS)
def test_expected_slices_and_chunked_check_agree_with_the_whole(op):
    for n in (1, 2, 3):
        for rank in range(n):
            full = bench.expected(op, rank, n, 10, torch.float32, "avg", root=n - 1)
            for start, length in ((0, 5), (3, 11), (7, full.numel() - 7)):
                length = min(length, full.numel() - start)
                part = bench.expected(op, rank, n, 10, torch.float32, "avg", n - 1, start, length)
                assert torch.equal(part, full[start:start + length]), (n, rank, start)
            assert bench.check_result(full, op, rank, n, 10, torch.float32, "avg", n - 1, chunk=7) == 0
            broken = full.clone()
            broken[-1] += 1
            assert bench.check_result(broken, op, rank, n, 10, torch.float32, "avg", n - 1, chunk=7) == 1


# ---------------------------------------------------------------------------- step benchmarks
@pytest.mark.mpi
@pytest.mark.parametrize("script, rows", [
    ("ddp_step.py", ("smddp DDP (its defaults)", "no hook (SMDDP_DDP_HOOK=0)", "torch DDP on gloo",
                     "no communication", "no DDP (compute only)")),
    ("fsdp_step.py", ("fully_shard on smddp", "fully_shard on gloo", "no FSDP (compute only)")),
])
def test_step_benchmark_tiny_run_reports_every_contender(script, rows):
    """One tiny job per world size under mpirun: the report has every contender's row and the machine."""
    res = python([str(ROOT / "benchmarks" / script), "--jobs", "1", "--rounds", "1", "--warmup", "0",
                  "--block", "1", "--layers", "16,32,8"], timeout=240)
    res.check()
    for row in rows:
        assert any(line.startswith("| ") and row in line for line in res.stdout.splitlines()), (row, res.output)
    assert "load average" in res.stdout and "command: python" in res.stdout, res.output


def test_work_overhead_tiny_run_reports_every_call():
    """benchmarks/work_overhead.py in a world of 1: each call timed, with the machine and the command."""
    res = python([str(ROOT / "benchmarks" / "work_overhead.py"), "--iters", "20", "--rounds", "1"], timeout=120)
    res.check()
    for call in ("sync", "async", "async-broadcast"):
        assert any(line.strip().startswith(f"{call}:") and line.endswith("us per call")
                   for line in res.stdout.splitlines()), (call, res.output)
    assert "load average" in res.stdout and "# python benchmarks/work_overhead.py" in res.stdout, res.output
