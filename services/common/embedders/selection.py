"""Which engine, device and precision serve the local models on this machine: one table
(`BACKENDS`), read by `select`, which the operator's settings can override:

    KBMESH_LOCAL_DEVICE     auto (a CUDA GPU where torch sees one, else the CPU) | cpu | cuda
    KBMESH_LOCAL_PRECISION  auto (the table's) | fp32 | int8 (CPU only)
    KBMESH_LOCAL_BACKEND    auto (the table's engine, documents in child processes on CPU)
                            | onnx (onnxruntime in this process) | torch (fp32, the reference)

On a GPU under `auto`, documents run there and queries on whichever of the GPU and the CPU's
own engine answers one short text faster (`engine.faster_for_queries`, timed at load).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from services.common.embedders.cpu import cpu_kind, usable_cores, usable_physical_cores
from services.common.embedders.processes import document_workers
from services.common.settings import LOCAL_BACKEND
from services.common.settings import LocalBackend as Backend
from services.common.settings import LocalDevice as Device
from services.common.settings import LocalPrecision as Precision

Engine = Literal["onnxruntime", "torch"]

Served = Literal["fp32", "fp16", "int8"]  # the precision a model runs in

# Hardware kind (`cpu.CPU_KINDS`, or "cuda") → the engine and precision `auto` serves with.
# int8 where hybrid MRR@10 stays within 0.005 of fp32 on every quality set (docs/benchmarks.md,
# "Precision"): measured on `avx2`, whose integer sums could saturate, and `amx`; 7-bit weights
# make them exact on `avx2`, as VNNI and AMX are by construction (tested): all x86 kinds agree.
# fp16 on CUDA, the stated rule: on an H200 its vectors are within cosine 0.99976 of fp32
# (the minimum over real chunks) at 1.59x fp32's chunks/s. That distance is a thirtieth of
# int8's (0.9924 on queries), which kept every quality set within 0.005; and on CPU fp16 gave
# the stdlib set's dense MRR@10 exactly (docs/benchmarks.md, "Engines"). int8 has no place
# on the GPU: torch has no such kernels for this model, and fp16 is near-exact.
BACKENDS: dict[str, tuple[Engine, Served]] = {
    "cuda": ("torch", "fp16"),
    "amx": ("onnxruntime", "int8"),
    "avx512_vnni": ("onnxruntime", "int8"),
    "avx_vnni": ("onnxruntime", "int8"),
    "avx2": ("onnxruntime", "int8"),
    "other": ("onnxruntime", "fp32"),
}


@dataclass(frozen=True)
class Selection:
    engine: Engine
    device: Literal["cpu", "cuda"]
    precision: Served
    hardware: str  # the row of `BACKENDS`
    processes: int  # document child processes; 0: documents in this process
    threads: int  # of each child, else of this process's sessions
    # On a GPU: the precision of the CPU's own onnxruntime engine (its row of `BACKENDS`),
    # which answers queries instead where `engine.faster_for_queries` says so at load. None: queries
    # run on the document engine.
    query_cpu: Literal["fp32", "int8"] | None = None

    def __str__(self) -> str:  # as the log line `embedder_loaded` shows it
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def cuda_available() -> bool:
    """Whether torch can use a CUDA device. Without an NVIDIA driver loaded, answered
    without importing torch, so a server on a CPU machine never pays for that import."""
    if not (Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidia0").exists()):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cpu_precision() -> Literal["fp32", "int8"]:
    """The precision `auto` serves with on this machine's CPU (its kind's row of `BACKENDS`)."""
    return "int8" if BACKENDS[cpu_kind()][1] == "int8" else "fp32"


def select(
    backend: Backend = LOCAL_BACKEND,
    device: Device = "auto",
    precision: Precision = "auto",
    *,
    processes: int = 0,
) -> Selection:
    """ValueError for a combination that cannot run here (`cuda` without a usable GPU,
    int8 on torch). The torch backend is the fp32 reference on a GPU too."""
    if device == "cuda" and not cuda_available():
        raise ValueError("local device cuda: no CUDA device that torch can use")
    gpu = device == "cuda" or (device == "auto" and backend != "onnx" and cuda_available())
    hardware = "cuda" if gpu else cpu_kind()
    engine, table_precision = BACKENDS[hardware]
    if backend != "auto":
        engine = "torch" if backend == "torch" or gpu else "onnxruntime"
        table_precision = "fp32"
    chosen: Served = table_precision if precision == "auto" else precision
    if chosen == "int8" and engine == "torch":
        raise ValueError("precision int8 runs on onnxruntime only (CPU); torch runs fp32/fp16")
    # A second engine for queries only where the operator left both choices to the table.
    query_cpu = cpu_precision() if gpu and backend == "auto" and precision == "auto" else None
    children = backend == "auto" and not gpu
    workers, threads = document_workers(usable_cores(), processes) if children else (0, 0)
    return Selection(
        engine=engine,
        device="cuda" if gpu else "cpu",
        precision=chosen,
        hardware=hardware,
        processes=workers,
        threads=threads or usable_physical_cores(),
        query_cpu=query_cpu,
    )
