"""The worker process of tests/comm/backends/nccl/test_gpu.py: ``python tests/ranks/gpu_worker.py CHECK BACKEND``.

Run under plain ``python`` (a world of one) or ``mpirun -np N``. Every rank builds every
rank's inputs from seeds, so it knows the exact answer without communicating; it prints
``CHECK <rank> <name>`` per passed check and ``PASSED <rank> <count>`` at the end, and saves its
results (``SMDDP_GPU_OUT``) so a test can compare the ``nccl`` backend with torch's NCCL group.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.uint8, torch.int8, torch.int32, torch.int64]
SIZES = [17, 1_000_003]


def gather_into(output: torch.Tensor, input: torch.Tensor):
    """All-gather into one tensor through the smddp group, as torch's DDP and FSDP call it.

    ``torch.distributed.all_gather_into_tensor`` of torch >= 2.13 goes to a C++ method
    that does not reach a Python group, so the group's ``_allgather_base`` is called.
    """
    from smddp.torch import groups

    return groups.current()._allgather_base(output, input)


class Worker:
    def __init__(self, check: str, backend: str):
        self.check, self.backend = check, backend
        self.count = 0
        self.results: dict = {}

    def start(self):
        import smddp.torch.distributed as dist

        dist.init_process_group(backend=self.backend)
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        if self.backend in ("nccl", "torch-nccl"):
            torch.cuda.set_device(dist.get_local_rank())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:  # the same checks on CPU backends: how the worker itself is checked without a GPU
            self.device = torch.device("cpu")
        assert dist.get_backend() == self.backend, (dist.get_backend(), self.backend)
        self.passed(f"backend/{self.backend}")
        return dist

    def passed(self, name: str) -> None:
        self.count += 1
        print(f"CHECK {self.rank} {name}", flush=True)

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        self.results[name] = tensor.detach().cpu().clone()

    def finish(self) -> None:
        out = os.environ.get("SMDDP_GPU_OUT")
        if out:
            torch.save(self.results, Path(out) / f"{self.check}-{self.backend}-rank{self.rank}.pt")
        if getattr(self, "dist", None) is not None and self.dist.is_initialized():
            self.dist.destroy_process_group()
        print(f"PASSED {self.rank} {self.count}", flush=True)

    # ------------------------------------------------------------------ inputs
    def inputs(self, r: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * r + numel + salt)
        if dtype.is_floating_point:
            t = torch.randn(numel, generator=g, dtype=torch.float64)
        else:
            t = torch.randint(0 if dtype == torch.uint8 else -20, 40, (numel,), generator=g, dtype=torch.int64)
        return t.to(dtype)

    def expected(self, stack: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
        wide = stack.to(torch.float64 if dtype.is_floating_point else torch.int64)
        if op == "sum":
            out = wide.sum(0)
        elif op == "average":
            out = wide.sum(0) / self.size if dtype.is_floating_point else torch.div(
                wide.sum(0), self.size, rounding_mode="trunc")
        elif op == "min":
            out = wide.min(0).values
        elif op == "max":
            out = wide.max(0).values
        else:
            out = wide.prod(0)
        return out.to(dtype)

    @staticmethod
    def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        actual, expected = actual.cpu(), expected.cpu()
        if actual.dtype in (torch.float16, torch.bfloat16):
            torch.testing.assert_close(actual.double(), expected.double(), rtol=3e-2, atol=3e-2, msg=lambda m: what + m)
        elif actual.dtype.is_floating_point:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: what + m)
        else:
            assert torch.equal(actual, expected), f"{what}: {actual[:8]} != {expected[:8]}"

    # ------------------------------------------------------------------ collectives
    def run_collectives(self) -> None:
        import torch.distributed as tdist

        dist = self.start()
        ops = {"sum": dist.ReduceOp.SUM, "average": dist.ReduceOp.AVERAGE, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX}
        for dtype in DTYPES:
            for numel in SIZES:
                stack = torch.stack([self.inputs(r, numel, dtype) for r in range(self.size)])
                for name, op in ops.items():
                    t = stack[self.rank].clone().to(self.device)
                    dist.all_reduce(t, op=op)
                    self.close(t, self.expected(stack, name, dtype), f"all_reduce {name} {dtype} {numel}")
                    self.keep(f"all_reduce/{name}/{dtype}/{numel}", t)
            small = torch.stack([self.inputs(r, 64, dtype, salt=9).clamp(-2, 3) for r in range(self.size)])
            t = small[self.rank].clone().to(self.device)
            tdist.all_reduce(t, op=tdist.ReduceOp.PRODUCT)  # torch's API: smddp's v1 API has no PRODUCT
            self.close(t, self.expected(small, "product", dtype), f"all_reduce product {dtype}")
            self.passed(f"all_reduce/{dtype}")

        # a CPU metric in a GPU job goes through the CPU communicator
        loss = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(loss, op=dist.ReduceOp.AVERAGE)
        assert loss.device.type == "cpu" and loss.item() == (self.size + 1) / 2, loss
        self.passed("cpu_tensor_in_gpu_job")

        base = torch.stack([self.inputs(r, 48, torch.float32, salt=7) for r in range(self.size)]).view(
            self.size, 6, 8)
        mine = base[self.rank].clone().to(self.device)
        view = mine[:, ::2]
        dist.all_reduce(view, op=dist.ReduceOp.MAX)
        self.close(mine[:, ::2], base.max(0).values[:, ::2], "strided all_reduce")
        self.close(mine[:, 1::2], base[self.rank][:, 1::2], "elements outside the view")
        empty = torch.empty(0, device=self.device)
        dist.all_reduce(empty)
        self.passed("non_contiguous_and_empty")

        for src in sorted({0, self.size - 1}):
            for dtype in DTYPES:
                t = self.inputs(self.rank, 33, dtype, salt=src).to(self.device)
                dist.broadcast(t, src=src)
                self.close(t, self.inputs(src, 33, dtype, salt=src), f"broadcast from {src} {dtype}")
                self.keep(f"broadcast/{src}/{dtype}", t)
        self.passed("broadcast")

        for dtype in DTYPES:
            mine = self.inputs(self.rank, 12, dtype, salt=3).view(3, 4).to(self.device)
            out = [torch.empty(3, 4, dtype=dtype, device=self.device) for _ in range(self.size)]
            dist.all_gather(out, mine)
            for r in range(self.size):
                self.close(out[r], self.inputs(r, 12, dtype, salt=3).view(3, 4), f"all_gather slot {r} {dtype}")
            flat = torch.empty(self.size * 12, dtype=dtype, device=self.device)
            gather_into(flat, mine.view(-1)).wait()
            self.close(flat, torch.cat([self.inputs(r, 12, dtype, salt=3) for r in range(self.size)]),
                       f"all_gather_into_tensor {dtype}")
        self.passed("all_gather")

        def send_sizes(i):  # rank i sends i + j + 1 rows to rank j: uneven everywhere
            return [i + j + 1 for j in range(self.size)]

        def rows_of(i):
            return torch.stack([self.inputs(i, 2, torch.int64, salt=200 + k) for k in range(sum(send_sizes(i)))])

        in_splits = send_sizes(self.rank)
        out_splits = [send_sizes(i)[self.rank] for i in range(self.size)]
        out = torch.empty(sum(out_splits), 2, dtype=torch.int64, device=self.device)
        dist.all_to_all_single(out, rows_of(self.rank).to(self.device), output_split_sizes=out_splits,
                               input_split_sizes=in_splits)
        offset = 0
        for src in range(self.size):
            start = sum(send_sizes(src)[:self.rank])
            self.close(out[offset:offset + out_splits[src]], rows_of(src)[start:start + out_splits[src]],
                       f"uneven all_to_all from {src}")
            offset += out_splits[src]
        self.keep("all_to_all", out)
        even = torch.arange(4 * self.size, dtype=torch.float32, device=self.device) + 100 * self.rank
        got = torch.empty_like(even)
        dist.all_to_all_single(got, even)
        expect = torch.cat([torch.arange(4.0) + 4 * self.rank + 100 * r for r in range(self.size)])
        self.close(got, expect, "even all_to_all")
        self.passed("all_to_all")

        tensors = [torch.full((1000,), float(self.rank + i), device=self.device) for i in range(4)]
        handles = [dist.all_reduce(t, async_op=True) for t in tensors]
        handles.append(dist.barrier(async_op=True))
        for h in handles:
            h.wait()
            assert h.is_completed()
        for i, t in enumerate(tensors):
            self.close(t, torch.full((1000,), float(sum(r + i for r in range(self.size)))), "async all_reduce")
        dist.barrier()
        self.passed("async_and_barrier")
        self.finish()

    # ------------------------------------------------------------------ streams
    def run_streams(self) -> None:
        import torch.distributed as tdist

        self.start()
        cycles = self._cycles_for(0.3)
        n = 1 << 20
        expected = torch.cat([torch.full((n,), float(r + 1)) for r in range(self.size)])

        # 1. a kernel queued before the collective, on the same stream, is seen by it
        src = torch.zeros(n, device=self.device)
        out = torch.zeros(self.size * n, device=self.device)
        side = torch.cuda.Stream(self.device)
        # The communicator first: NCCL's set-up (lazy, at the first collective, in torch's group
        # as in smddp's) synchronizes the device, so it would wait for the sleep below.
        gather_into(out, src).wait()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            src.fill_(float(self.rank + 1))
            t0 = time.perf_counter()
            work = gather_into(out, src)
            work.wait()
            waited = time.perf_counter() - t0
            seen = out.clone()  # a kernel queued after the collective sees its result
        torch.cuda.synchronize()
        assert torch.equal(seen.cpu(), expected), "the collective ran before the kernel queued ahead of it"
        assert waited < 0.15, f"wait() blocked the host for {waited:.3f} s while the GPU slept 0.3 s"
        self.passed("streams/before")

        # 2. waited on from another stream: that stream waits for the collective
        src.zero_()
        out.zero_()
        other = torch.cuda.Stream(self.device)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            src.fill_(float(self.rank + 1))
            work = gather_into(out, src)
        with torch.cuda.stream(other):
            work.wait()
            seen = out.clone()
        torch.cuda.synchronize()
        assert torch.equal(seen.cpu(), expected), "a stream that waited on the work read the result too early"
        self.passed("streams/other_stream")

        # 3. the same through DDP-style futures
        t = torch.full((n,), float(self.rank + 1), device=self.device)
        fut = tdist.all_reduce(t, async_op=True).get_future()
        value = fut.wait()[0]
        self.close(value, torch.full((n,), float(sum(range(1, self.size + 1)))), "future value")
        self.passed("streams/future")

        # 4. the future is CUDA-aware: waited on from another stream, that stream waits for the collective
        t = torch.zeros(n, device=self.device)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            t.fill_(float(self.rank + 1))
            fut = tdist.all_reduce(t, async_op=True).get_future()
        with torch.cuda.stream(other):
            seen = fut.wait()[0].clone()
        torch.cuda.synchronize()
        self.close(seen, torch.full((n,), float(sum(range(1, self.size + 1)))), "future waited from another stream")
        self.passed("streams/future_other_stream")
        self.finish()

    def _cycles_for(self, seconds: float) -> int:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        probe = 50_000_000
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        return int(probe * seconds * 1000 / max(start.elapsed_time(end), 1e-3))

    # ------------------------------------------------------------------ deadlines
    def _nccl_comm(self):
        from smddp.torch import groups

        return groups.current().engine.comms["cuda"]

    def run_deadlines(self) -> None:
        dist = self.start()
        comm = self._nccl_comm()
        t = torch.full((1000,), float(self.rank + 1), device=self.device)
        dist.all_reduce(torch.ones(1, device=self.device))  # the communicator exists
        torch.cuda.synchronize()
        torch.cuda._sleep(self._cycles_for(0.5))
        dist.all_reduce(t)
        assert comm.watch.drain(), "an operation that completes was reported expired"
        time.sleep(3)  # past the 2 s deadline of that all_reduce
        dist.all_reduce(t)
        dist.barrier()
        self.close(t, torch.full((1000,), float(sum(range(1, self.size + 1)) * self.size)), "all_reduce")
        assert not comm.watch.expired and comm._lane.comm is not None
        self.passed("deadlines/not_expired")
        dist.destroy_process_group()
        assert comm._lane.comm is None and not comm.watch.expired
        self.passed("deadlines/closed")
        self.finish()

    def run_stall(self) -> None:
        """A collective queued behind a 6 s kernel misses its 1 s deadline. With
        SMDDP_NCCL_ASYNC_ERROR_HANDLING=2 the communicator is aborted and the next call raises;
        by default (torch's 3) the watchdog ends the process."""
        import smddp

        dist = self.start()
        comm = self._nccl_comm()
        t = torch.ones(1000, device=self.device)
        dist.all_reduce(t)  # the communicator exists before the GPU is kept busy
        torch.cuda.synchronize()
        torch.cuda._sleep(self._cycles_for(6.0))
        dist.all_reduce(t)  # queued behind the 6 s kernel
        assert not comm.watch.expired, "the host waited for the GPU (past the deadline)"
        self.passed("stall/host_did_not_wait")
        if os.environ.get("SMDDP_NCCL_ASYNC_ERROR_HANDLING") != "2":
            time.sleep(30)  # the watchdog ends the process meanwhile
            print("STILL RUNNING", flush=True)
            return
        assert not comm.watch.drain() and comm.watch.expired, "the watchdog did not expire the all_reduce"
        assert comm._lane.comm is None, "the NCCL communicator was not aborted"
        self.passed("stall/expired")
        try:
            dist.all_reduce(t)
        except smddp.CollectiveTimeout as exc:
            assert "did not complete within 1 s" in str(exc), exc
        else:
            raise AssertionError("the call after a timeout did not raise CollectiveTimeout")
        self.passed("stall/next_call_raises")
        dist.destroy_process_group()
        self.passed("stall/destroyed")
        print(f"PASSED {self.rank} {self.count}", flush=True)

    # ------------------------------------------------------------------ device and dtypes
    def run_device(self) -> None:
        """init_process_group(device_id=...) without set_device: the group runs there, made at
        its first collective, and the caller's current device is left alone."""
        import smddp
        import smddp.torch.distributed as dist

        count = torch.cuda.device_count()
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0")))
        target = torch.device("cuda", (count - 1 - local) % count)  # not the local rank where it can differ
        dist.init_process_group(backend=self.backend, device_id=target)
        self.dist, self.rank, self.size = dist, dist.get_rank(), dist.get_world_size()
        comm = self._nccl_comm()
        if self.backend == "nccl":
            assert comm._lane is None, "the NCCL communicator was made at init"
        before = torch.cuda.current_device()
        t = torch.full((64,), float(self.rank + 1), device=target)
        dist.all_reduce(t)
        self.close(t, torch.full((64,), float(sum(range(1, self.size + 1)))), "all_reduce on device_id")
        assert comm.device == target, (comm.device, target)
        assert torch.cuda.current_device() == before, "the group changed the caller's current device"
        self.passed("device/device_id")
        if count > 1:
            other = torch.device("cuda", (target.index + 1) % count)
            try:
                dist.all_reduce(torch.ones(4, device=other))
            except smddp.InvalidArgumentError as exc:
                assert str(target) in str(exc) and str(other) in str(exc), exc
            else:
                raise AssertionError("a tensor on another device than the group's was accepted")
            self.passed("device/other_device_refused")
        self.finish()

    def run_dtypes(self) -> None:
        """bool, complex and float8 as torch's NCCL group sends them; int16 refused; DDP on a
        model with a bool buffer (DDP broadcasts every buffer)."""
        import smddp
        from smddp.torch.parallel.distributed import DistributedDataParallel as DDP

        dist = self.start()
        flags = torch.stack([self.inputs(r, 33, torch.int64, salt=5) % 2 == 0 for r in range(self.size)])
        for name, op, want in (("sum", dist.ReduceOp.SUM, flags.any(0)), ("min", dist.ReduceOp.MIN, flags.all(0)),
                               ("max", dist.ReduceOp.MAX, flags.any(0))):
            t = flags[self.rank].clone().to(self.device)
            dist.all_reduce(t, op=op)
            assert torch.equal(t.cpu(), want), f"bool all_reduce {name}"
            self.keep(f"bool/{name}", t)
        b = flags[self.rank].clone().to(self.device)
        dist.broadcast(b, src=0)
        assert torch.equal(b.cpu(), flags[0])
        waves = torch.stack([torch.complex(self.inputs(r, 40, torch.float32, salt=6),
                                           self.inputs(r, 40, torch.float32, salt=7)) for r in range(self.size)])
        for name, op in (("sum", dist.ReduceOp.SUM), ("average", dist.ReduceOp.AVERAGE)):
            t = waves[self.rank].clone().to(self.device)
            dist.all_reduce(t, op=op)
            want = waves.to(torch.complex128).sum(0) / (self.size if name == "average" else 1)
            self.close(torch.view_as_real(t), torch.view_as_real(want.to(torch.complex64)), f"complex {name}")
            self.keep(f"complex/{name}", t)
        try:
            dist.all_reduce(torch.ones(4, dtype=torch.int16, device=self.device))
        except TypeError as exc:
            assert isinstance(exc, smddp.SMDDPError), exc
        else:
            raise AssertionError("int16 was accepted (torch's NCCL group refuses it)")
        self.passed("dtypes/bool_complex_int16")
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2).to(self.device)
        model.register_buffer("mask", torch.tensor([True, False], device=self.device))
        ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(2):
            x, y = self._batch(self.rank, step)
            loss = torch.nn.functional.mse_loss(ddp(x[:, :8].to(self.device)), y[:, :2].to(self.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.passed("dtypes/ddp_with_a_bool_buffer")
        self.finish()

    # ------------------------------------------------------------------ training
    def _model(self, seed: int = 0):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    def _batch(self, r: int, step: int):
        g = torch.Generator().manual_seed(10_000 * step + r)
        return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)

    def run_ddp(self) -> None:
        from smddp.torch.parallel.distributed import DistributedDataParallel as DDP

        dist = self.start()
        model = self._model(seed=self.rank).to(self.device)  # DDP must broadcast rank 0's weights
        reference = self._model(seed=0).to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DDP(model, device_ids=device_ids)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q), "DDP did not start from rank 0's weights"
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(5):
            batches = [self._batch(r, step) for r in range(self.size)]
            x, y = (t.to(self.device) for t in batches[self.rank])
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref_opt.zero_grad()
            ref_loss = sum(torch.nn.functional.mse_loss(reference(bx.to(self.device)), by.to(self.device))
                           for bx, by in batches) / self.size
            ref_loss.backward()
            ref_opt.step()
            metric = loss.detach().cpu().view(1)  # a CPU tensor, reduced in the same GPU job
            dist.all_reduce(metric, op=dist.ReduceOp.AVERAGE)
            self.close(metric, ref_loss.detach().cpu().view(1), f"averaged loss, step {step}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"parameter {name}")
            self.keep(name, p)
        self.passed("ddp/5_steps")

        # bf16 model, as SageMaker users train: runs and stays finite
        model16 = self._model(seed=1).to(self.device, torch.bfloat16)
        ddp16 = DDP(model16, device_ids=device_ids)
        opt16 = torch.optim.SGD(ddp16.parameters(), lr=0.05)
        for step in range(3):
            x, y = (t.to(self.device, torch.bfloat16) for t in self._batch(self.rank, step))
            loss = torch.nn.functional.mse_loss(ddp16(x), y)
            opt16.zero_grad()
            loss.backward()
            opt16.step()
        assert all(torch.isfinite(p).all() for p in model16.parameters())
        self.passed("ddp/bf16")
        self.finish()

    # ------------------------------------------------------------------ torch's hooks and SyncBatchNorm
    def run_hooks(self) -> None:
        """torch's DDP with its fp16 and bf16 compression hooks (a ``then`` callback on the
        all-reduce's CUDA-aware future decompresses) and a model with ``SyncBatchNorm`` (its
        statistics all-gathered where the world has several ranks): trained, checked finite, kept
        for the comparison with torch's NCCL group. On a CPU backend only the fp16 hook (torch
        refuses the bf16 one and SyncBatchNorm without a GPU)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.start()
        cuda = self.device.type == "cuda"
        device_ids = [self.device.index] if cuda else None
        hooks = {"fp16": default_hooks.fp16_compress_hook}
        if cuda:
            hooks["bf16"] = default_hooks.bf16_compress_hook
        for name, hook in hooks.items():
            model = self._model(seed=3).to(self.device)
            ddp = DDP(model, device_ids=device_ids)
            ddp.register_comm_hook(None, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step in range(4):
                x, y = (t.to(self.device) for t in self._batch(self.rank, step))
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
            assert all(torch.isfinite(p).all() for p in model.parameters()), name
            for pname, p in model.named_parameters():
                self.keep(f"{name}/{pname}", p)
            self.passed(f"hooks/{name}")
        if cuda:
            torch.manual_seed(4)
            net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                      torch.nn.Linear(16, 8))
            net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).to(self.device)
            ddp = DDP(net, device_ids=device_ids)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step in range(4):
                x, y = (t.to(self.device) for t in self._batch(self.rank, step))
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
            state = net.state_dict()
            assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
            for key, value in state.items():
                self.keep(f"syncbn/{key}", value)
            self.passed("hooks/syncbn")
        self.finish()

    # ------------------------------------------------------------------ the host never waits
    def run_host_free(self) -> None:
        """An asynchronous all-reduce and a DDP backward queued behind a 1 s kernel: the host gets
        past ``wait()`` and ``backward()`` long before the kernel ends (the future is CUDA-aware and
        complete at enqueue, as torch's NCCL group's), and the results are right once it has."""
        import torch.distributed as tdist
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.start()
        cycles = self._cycles_for(1.0)
        n = 1 << 20
        t = torch.zeros(n, device=self.device)
        tdist.all_reduce(t)  # the communicator first: its set-up synchronizes the device
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t.fill_(float(self.rank + 1))
        start = time.perf_counter()
        work = tdist.all_reduce(t, async_op=True)
        work.wait()
        future = work.get_future()
        waited = time.perf_counter() - start
        assert waited < 0.5, f"all_reduce(async_op=True).wait() blocked the host {waited:.3f} s behind a 1 s kernel"
        assert future.done(), "the Work's future was not complete at enqueue"
        self.close(future.wait()[0], torch.full((n,), float(sum(range(1, self.size + 1)))), "async all_reduce")
        self.passed("host_free/async_wait")

        model = DDP(self._model().to(self.device), device_ids=[self.device.index])
        x, y = (v.to(self.device) for v in self._batch(self.rank, 0))
        torch.nn.functional.mse_loss(model(x), y).backward()  # the buckets are made and rebuilt
        model.zero_grad()
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        waited = time.perf_counter() - start
        assert waited < 0.5, f"DDP's backward blocked the host {waited:.3f} s behind a 1 s kernel"
        torch.cuda.synchronize()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        self.passed("host_free/ddp_backward")
        self.finish()

    # ------------------------------------------------------------------ CUDA graphs
    def run_graph(self) -> None:
        """All-reduces (synchronous and asynchronous) captured by ``torch.cuda.graph`` and replayed
        with new inputs give each replay's sums, as on torch's NCCL group."""
        import torch.distributed as tdist

        self.start()
        n = 4096
        t = torch.zeros(n, device=self.device)
        u = torch.zeros(n, device=self.device, dtype=torch.bfloat16)
        capture = torch.cuda.Stream(self.device)
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):  # warm-up on the capture stream, as torch's docs ask
            tdist.all_reduce(t)
            tdist.all_reduce(u, async_op=True).wait()
        torch.cuda.current_stream().wait_stream(capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            tdist.all_reduce(t)
            tdist.all_reduce(u, op=tdist.ReduceOp.MAX, async_op=True).wait()
        for replay in range(3):
            inputs = [self.inputs(r, n, torch.float32, 100 + replay) for r in range(self.size)]
            halves = [self.inputs(r, n, torch.bfloat16, 200 + replay) for r in range(self.size)]
            t.copy_(inputs[self.rank].to(self.device))
            u.copy_(halves[self.rank].to(self.device))
            graph.replay()
            torch.cuda.synchronize()
            self.close(t, self.expected(torch.stack(inputs), "sum", torch.float32), f"replay {replay}: sum")
            assert torch.equal(u.cpu(), self.expected(torch.stack(halves), "max", torch.bfloat16)), f"replay {replay}"
        self.passed("graph/replays")
        self.finish()

    # ------------------------------------------------------------------ without CuPy
    def run_no_cupy(self) -> None:
        sys.modules["cupy"] = None  # as if CuPy were not installed
        import dataclasses

        import smddp
        import smddp.comm as comm
        import smddp.torch.distributed as dist
        from smddp.job.topology import discover

        self.rank = 0
        try:
            dist.init_process_group(backend="nccl")
        except smddp.BackendUnavailableError as exc:
            assert "smddp[cuda12]" in str(exc) and "torch-nccl" in str(exc), exc
        else:
            raise AssertionError("backend='nccl' started without CuPy")
        found = dataclasses.replace(comm.probe(), cupy=False)
        assert comm.choose_backend(None, {}, discover({"RANK": "0", "WORLD_SIZE": "2"}), found) == "torch-nccl"
        self.passed("no_cupy/fallback")
        self.finish()


def main(argv) -> None:
    check, backend = argv[1], argv[2]
    worker = Worker(check, backend)
    getattr(worker, f"run_{check}")()


if __name__ == "__main__":
    main(sys.argv)
