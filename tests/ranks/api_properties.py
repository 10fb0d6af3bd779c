"""Property-based checks of smddp's public collectives (hypothesis).

Each property draws arguments -- dtypes, shapes, layouts, ops, roots, split sizes, groups,
non-tensors -- and checks that the call either gives exactly what a single-process reference
computes, or raises the documented exception for one of the bad arguments it was given;
never anything else, never a hang.

Used two ways:

- ``tests/torch/test_properties.py`` runs every property in a world of one, in pytest's process.
- ``mpirun -np 2 python tests/ranks/api_properties.py N`` runs them in a real job, N examples
  each. Every rank must draw the same examples: generation is derandomized (the same seed on
  every rank), shrinking is off (it would follow one rank's failure), and before each example
  the ranks compare a digest of what they drew. Arguments that are valid on one rank are valid
  on all, so no rank is left waiting for another.

Every example's tensors are built from a seed with small integer values, so that sums,
averages and extremes are exact in every dtype, and the reference for rank ``r`` is computed
from all ranks' inputs here, without communication.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as tdist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import smddp
import smddp.torch.distributed as dist
from smddp.torch import groups as smddp_groups

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool, "complex64": torch.complex64,
}
# Each op as the caller may spell it, and the reduction it means (None: not accepted).
OPS = {
    "AVERAGE": (lambda: dist.ReduceOp.AVERAGE, "avg"), "SUM": (lambda: dist.ReduceOp.SUM, "sum"),
    "MIN": (lambda: dist.ReduceOp.MIN, "min"), "MAX": (lambda: dist.ReduceOp.MAX, "max"),
    "torch.AVG": (lambda: tdist.ReduceOp.AVG, "avg"), "torch.SUM": (lambda: tdist.ReduceOp.SUM, "sum"),
    "torch.MIN": (lambda: tdist.ReduceOp.MIN, "min"), "torch.MAX": (lambda: tdist.ReduceOp.MAX, "max"),
    "None": (lambda: None, "sum"), "torch.PRODUCT": (lambda: tdist.ReduceOp.PRODUCT, None),
    "torch.BAND": (lambda: tdist.ReduceOp.BAND, None), "torch.BXOR": (lambda: tdist.ReduceOp.BXOR, None),
    "'sum'": (lambda: "sum", None), "3": (lambda: 3, None), "object()": (lambda: object(), None),
}
# Each group as the caller may pass it; True: accepted.
GROUPS = {
    "group.WORLD": (lambda: dist.group.WORLD, True), "None": (lambda: None, True),
    "torch WORLD": (lambda: tdist.group.WORLD, True), "'world'": (lambda: "world", False),
    "0": (lambda: 0, False), "object()": (lambda: object(), False),
}
# Things that are not tensors, passed where a tensor belongs.
NON_TENSORS = {
    "int": lambda: 3, "list": lambda: [1.0, 2.0], "None": lambda: None,
    "ndarray": lambda: __import__("numpy").ones(3, dtype="float32"),
}
LAYOUTS = ("contiguous", "transposed", "strided")

shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)
groups = st.sampled_from(sorted(GROUPS))
tensor_kinds = st.sampled_from(["tensor"] * 6 + sorted(NON_TENSORS))


# ---------------------------------------------------------------------------- building tensors
def values(seed: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in every dtype) from ``seed``, as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    low = 0 if dtype in (torch.uint8, torch.bool) else -3
    t = torch.randint(low, 4, tuple(shape), generator=g, dtype=torch.int64)
    return (t > 0) if dtype is torch.bool else t.to(dtype)


def laid_out(t: torch.Tensor, layout: str, requires_grad: bool) -> torch.Tensor:
    """``t``'s values in a tensor with the given memory layout."""
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    elif layout == "strided" and t.dim() >= 1:
        big = torch.zeros((t.shape[0] * 2, *t.shape[1:]), dtype=t.dtype)
        big[::2] = t
        t = big[::2]
    else:
        t = t.clone()
    if requires_grad and t.is_contiguous() and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t


def supported() -> Set[torch.dtype]:
    """The dtypes the running backend accepts (its communicator's documented ``dtypes``)."""
    return set(smddp_groups.current().engine.primary.dtypes)


def reduce_reference(stack: torch.Tensor, how: str, dtype: torch.dtype) -> torch.Tensor:
    """What all-reducing the rows of ``stack`` gives, computed exactly then cast to ``dtype``."""
    if stack.shape[0] == 1:
        return stack[0].clone()
    wide = stack.to(torch.float64)
    if how == "sum":
        out = wide.sum(0)
    elif how == "avg":
        out = wide.sum(0) / stack.shape[0]
        if not (dtype.is_floating_point or dtype.is_complex):
            out = torch.trunc(out)
    elif how == "min":
        out = wide.amin(0)
    else:
        out = wide.amax(0)
    return out.to(dtype)


def same(actual, expected: torch.Tensor, what: str) -> None:
    actual = actual.detach()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual, expected)
    assert torch.equal(actual, expected), f"{what}: got {actual}, expected {expected}"


def outcome(call: Callable[[], object], allowed: Dict[type, str]) -> Optional[BaseException]:
    """Run ``call``; it must succeed when ``allowed`` is empty, else raise one of its types.

    Returns:
        The exception raised (checked), or None.
    """
    try:
        result = call()
    except smddp.SMDDPError as exc:
        assert allowed, f"unexpected {type(exc).__name__}: {exc}"
        assert any(isinstance(exc, kind) for kind in allowed), (
            f"raised {type(exc).__name__} ({exc}); expected one of: "
            + "; ".join(f"{k.__name__} for {why}" for k, why in allowed.items())
        )
        assert str(exc), "an error without a message"
        return exc
    assert not allowed, "no error, expected one of: " + "; ".join(
        f"{k.__name__} for {why}" for k, why in allowed.items())
    if result is not None:  # async_op=True
        assert result.wait() is True and result.is_completed()
    return None


def common_errors(case: dict) -> Dict[type, str]:
    errors: Dict[type, str] = {}
    if not GROUPS[case["group"]][1]:
        errors[smddp.InvalidGroupError] = f"group={case['group']}"
    return errors


# ---------------------------------------------------------------------------- all_reduce
@st.composite
def all_reduce_cases(draw) -> dict:
    return {
        "seed": draw(st.integers(0, 2**16)), "dtype": draw(st.sampled_from(sorted(DTYPES))), "shape": draw(shapes),
        "layout": draw(st.sampled_from(LAYOUTS)), "op": draw(st.sampled_from(sorted(OPS))),
        "group": draw(groups), "async_op": draw(st.booleans()), "kind": draw(tensor_kinds),
        "requires_grad": draw(st.booleans()),
    }


def check_all_reduce(case: dict, rank: int, size: int) -> None:
    dtype = DTYPES[case["dtype"]]
    stack = torch.stack([values(case["seed"] + r, case["shape"], dtype) for r in range(size)])
    tensor = laid_out(stack[rank], case["layout"], case["requires_grad"])
    make_op, how = OPS[case["op"]]
    errors = common_errors(case)
    if case["kind"] != "tensor":
        tensor = NON_TENSORS[case["kind"]]()
        errors[smddp.InvalidTypeError] = f"a {case['kind']} tensor"
    elif dtype not in supported():
        errors[smddp.InvalidTypeError] = f"dtype {dtype}"
    elif dtype is torch.bool and how == "avg":  # a mean of bools is no bool: refused on every backend
        errors[smddp.InvalidTypeError] = "AVERAGE of bool"
    if how is None:
        errors[smddp.InvalidArgumentError] = f"op={case['op']}"
    outcome(lambda: dist.all_reduce(tensor, op=make_op(), group=GROUPS[case["group"]][0](),
                                    async_op=case["async_op"]), errors)
    if not errors:
        same(tensor, reduce_reference(stack, how, dtype), f"all_reduce {case}")


# ---------------------------------------------------------------------------- broadcast
SRCS = {"0": 0, "1": 1, "2": 2, "-1": -1, "size": "size", "1.0": 1.0, "'0'": "0", "True": True, "None": None}


@st.composite
def broadcast_cases(draw) -> dict:
    return {
        "seed": draw(st.integers(0, 2**16)), "dtype": draw(st.sampled_from(sorted(DTYPES))), "shape": draw(shapes),
        "layout": draw(st.sampled_from(LAYOUTS)), "src": draw(st.sampled_from(sorted(SRCS))),
        "group": draw(groups), "async_op": draw(st.booleans()), "kind": draw(tensor_kinds),
    }


def check_broadcast(case: dict, rank: int, size: int) -> None:
    dtype = DTYPES[case["dtype"]]
    stack = torch.stack([values(case["seed"] + r, case["shape"], dtype) for r in range(size)])
    tensor = laid_out(stack[rank], case["layout"], False)
    src = SRCS[case["src"]]
    src = size if src == "size" else src
    errors = common_errors(case)
    if case["kind"] != "tensor":
        tensor = NON_TENSORS[case["kind"]]()
        errors[smddp.InvalidTypeError] = f"a {case['kind']} tensor"
    elif dtype not in supported():
        errors[smddp.InvalidTypeError] = f"dtype {dtype}"
    if isinstance(src, bool) or not isinstance(src, int):
        errors[smddp.InvalidTypeError] = f"src={src!r}"
    elif not 0 <= src < size:
        errors[smddp.InvalidArgumentError] = f"src={src} in a world of {size}"
    outcome(lambda: dist.broadcast(tensor, src=src, group=GROUPS[case["group"]][0](), async_op=case["async_op"]),
            errors)
    if not errors:
        same(tensor, stack[src], f"broadcast {case}")


# ---------------------------------------------------------------------------- all_gather
@st.composite
def all_gather_cases(draw) -> dict:
    return {
        "seed": draw(st.integers(0, 2**16)), "dtype": draw(st.sampled_from(sorted(DTYPES))), "shape": draw(shapes),
        "layout": draw(st.sampled_from(LAYOUTS)), "length": draw(st.sampled_from([0, 0, 0, 0, -1, 1])),
        "container": draw(st.sampled_from(["list", "list", "list", "tuple", "tensor", "None"])),
        "entry": draw(st.sampled_from(["same"] * 4 + ["flat", "numel+1", "other dtype", "not a tensor"])),
        "at": draw(st.integers(0, 3)), "group": draw(groups), "async_op": draw(st.booleans()),
        "kind": draw(tensor_kinds),
    }


def check_all_gather(case: dict, rank: int, size: int) -> None:
    dtype = DTYPES[case["dtype"]]
    shape = case["shape"]
    stack = torch.stack([values(case["seed"] + r, shape, dtype) for r in range(size)])
    tensor = laid_out(stack[rank], case["layout"], False)
    errors = common_errors(case)
    length = size + case["length"]
    numel = int(torch.Size(shape).numel())
    outs: List[object] = [torch.full(shape, 7, dtype=dtype) for _ in range(length)]
    at = case["at"] % length if length else None
    if at is not None:
        entry = case["entry"]
        if entry == "flat":
            outs[at] = torch.zeros(numel, dtype=dtype)
        elif entry == "numel+1":
            outs[at] = torch.zeros(numel + 1, dtype=dtype)
            errors[smddp.InvalidArgumentError] = "an output with another number of elements"
        elif entry == "other dtype":
            outs[at] = torch.zeros(shape, dtype=torch.float64 if dtype != torch.float64 else torch.float32)
            errors[smddp.InvalidTypeError] = "an output of another dtype"
        elif entry == "not a tensor":
            outs[at] = [0.0]
            errors[smddp.InvalidTypeError] = "an output that is not a tensor"
    if length != size:
        errors[smddp.InvalidArgumentError] = f"{length} outputs for {size} ranks"
    container = case["container"]
    if container == "tuple":
        tensor_list = tuple(outs)
    elif container == "tensor":
        tensor_list = torch.zeros(size, *shape, dtype=dtype)
        errors[smddp.InvalidTypeError] = "a tensor as tensor_list"
    elif container == "None":
        tensor_list = None
        errors[smddp.InvalidTypeError] = "tensor_list=None"
    else:
        tensor_list = outs
    if case["kind"] != "tensor":
        tensor = NON_TENSORS[case["kind"]]()
        errors[smddp.InvalidTypeError] = f"a {case['kind']} tensor"
    elif dtype not in supported():
        errors[smddp.InvalidTypeError] = f"dtype {dtype}"
    outcome(lambda: dist.all_gather(tensor_list, tensor, group=GROUPS[case["group"]][0](),
                                    async_op=case["async_op"]), errors)
    if not errors:
        for i, out in enumerate(outs):
            same(out, stack[i].reshape(out.shape), f"all_gather output {i} {case}")


# ---------------------------------------------------------------------------- all_to_all_single
SPLIT_MODES = ["explicit"] * 4 + ["equal", "equal", "too many", "negative", "sum+1", "float", "indivisible"]


@st.composite
def all_to_all_cases(draw) -> dict:
    return {
        "seed": draw(st.integers(0, 2**16)), "dtype": draw(st.sampled_from(sorted(DTYPES))),
        "tail": draw(st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)),
        "splits": draw(st.lists(st.integers(0, 3), min_size=9, max_size=9)),
        "equal": draw(st.integers(0, 2)), "mode": draw(st.sampled_from(SPLIT_MODES)),
        "side": draw(st.sampled_from(["input", "output"])), "layout": draw(st.sampled_from(LAYOUTS)),
        "group": draw(groups), "async_op": draw(st.booleans()), "kind": draw(tensor_kinds),
    }


def check_all_to_all(case: dict, rank: int, size: int) -> None:
    dtype = DTYPES[case["dtype"]]
    tail, mode = case["tail"], case["mode"]
    # S[i][j]: rows rank i sends to rank j.
    if mode in ("equal", "indivisible"):
        S = [[case["equal"]] * size for _ in range(size)]
    else:
        S = [[case["splits"][(i * 3 + j) % 9] for j in range(size)] for i in range(size)]
    inputs = [values(case["seed"] + i, (sum(S[i]), *tail), dtype) for i in range(size)]
    in_splits: Optional[list] = list(S[rank])
    out_splits: Optional[list] = [S[j][rank] for j in range(size)]
    out_rows = sum(out_splits)
    errors = common_errors(case)
    if mode == "equal":
        in_splits = out_splits = None
    elif mode == "indivisible":
        # size * equal rows (+1 when the world is larger than one: not divisible), no splits.
        extra = 1 if size > 1 else 0
        inputs = [values(case["seed"] + i, (size * case["equal"] + extra, *tail), dtype) for i in range(size)]
        out_rows = size * case["equal"] + extra
        in_splits = out_splits = None
        if extra:
            errors[smddp.InvalidArgumentError] = "a dim 0 that does not divide by the world size"
    elif mode != "explicit":
        bad = {"too many": lambda s: s + [0], "negative": lambda s: [-1] + s[1:] if s else [-1],
               "sum+1": lambda s: s[:-1] + [s[-1] + 1], "float": lambda s: [float(x) for x in s]}[mode]
        if case["side"] == "input":
            in_splits = bad(in_splits)
        else:
            out_splits = bad(out_splits)
        errors[smddp.InvalidArgumentError] = f"{case['side']}_split_sizes ({mode})"
    input_t = laid_out(inputs[rank], case["layout"], False)
    output_t = torch.full((out_rows, *tail), 7, dtype=dtype)
    if case["kind"] != "tensor":
        input_t = NON_TENSORS[case["kind"]]()
        errors[smddp.InvalidTypeError] = f"a {case['kind']} input"
    elif dtype not in supported():
        errors[smddp.InvalidTypeError] = f"dtype {dtype}"
    outcome(lambda: dist.all_to_all_single(output_t, input_t, out_splits, in_splits,
                                           group=GROUPS[case["group"]][0](), async_op=case["async_op"]), errors)
    if not errors:
        pieces = []
        for j in range(size):
            start = sum(S[j][:rank])
            pieces.append(inputs[j][start:start + S[j][rank]])
        same(output_t, torch.cat(pieces), f"all_to_all_single {case}")


# ---------------------------------------------------------------------------- barrier
@st.composite
def barrier_cases(draw) -> dict:
    return {"group": draw(groups), "async_op": draw(st.booleans())}


def check_barrier(case: dict, rank: int, size: int) -> None:
    outcome(lambda: dist.barrier(group=GROUPS[case["group"]][0](), async_op=case["async_op"]), common_errors(case))


PROPERTIES: Dict[str, Tuple[Callable, Callable]] = {
    "all_reduce": (all_reduce_cases, check_all_reduce),
    "broadcast": (broadcast_cases, check_broadcast),
    "all_gather": (all_gather_cases, check_all_gather),
    "all_to_all_single": (all_to_all_cases, check_all_to_all),
    "barrier": (barrier_cases, check_barrier),
}


def run(name: str, examples: int, rank: int, size: int, in_step: bool = False) -> int:
    """Run property ``name`` on ``examples`` generated cases; return how many ran.

    Args:
        in_step: before each case, check that every rank drew the same one (a job of many ranks).
    """
    strategy, check = PROPERTIES[name]
    count = 0

    def one(case: dict) -> None:
        nonlocal count
        count += 1
        if in_step:
            digest = int.from_bytes(hashlib.sha1(repr(sorted(case.items())).encode()).digest()[:7], "big")
            both = torch.tensor([digest, -digest], dtype=torch.int64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            assert both.tolist() == [digest, -digest], f"rank {rank} drew a case other ranks did not: {case}"
        check(case, rank, size)

    settings(
        max_examples=examples, derandomize=True, database=None, deadline=None,
        phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )(given(strategy())(one))()
    return count


if __name__ == "__main__":
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    torch.set_num_threads(1)
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    total = 0
    for prop in PROPERTIES:
        ran = run(prop, examples, rank, size, in_step=True)
        total += ran
        print(f"CASES {rank} {prop} {ran}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"PROPERTIES_OK {rank} {total}", flush=True)
