"""Device check of our KV data path without vLLM: the connector's real halves (block server, puller,
leases, checksums, layer-wise fills) on KV caches in GPU memory, in two processes, against torch's
own copies of the same bytes.

For each shape (the test model's, SmolLM2-135M, read from its config.json when present; and
Llama-3-8B's 32 layers x 8 KV heads x 128, hard-coded) at a ``--tokens`` prompt (7.5k by default on
CUDA) it reports:
  - D2H and H2D GB/s of the connector's staging copies (side stream, pinned mirror, per contiguous
    run of blocks), against the best torch copy of the same bytes in one piece (the ceiling);
  - CUDA IPC pull GB/s (device-to-device from the peer's mapped cache) against a device-to-device
    copy in one process;
  - shm and tcp pull GB/s between the two pinned mirrors (the transports as on host caches), and
    end to end (D2H + pull + H2D);
  - the fixed cost of a one-block pull per transport (median of ``--fixed-repeats``);
  - the exposed time of a whole-prompt pull (compute every layer, stage, pull, H2D) against a
    layer-wise one (the pull follows the layers as the prefill writes them), with a simulated
    compute per layer equal to the measured per-layer transfer time (``--layer-ms`` to set it);
  - whether checksums (xxh3-64 of every part of the staged blocks, the host path's function) are
    equal on both sides after every path.
Thresholds (issue 41): D2H/H2D >= 0.8x ceiling, IPC >= 0.8x d2d, layer-wise exposed <= 0.3x whole.

``--device cpu`` rehearses everything on host memory; the thresholds that only mean something on a
GPU (copy engines, IPC) are reported as skipped with the reason. Output: JSON (``--out``) and a
last line ``RESULT ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infra.device.kv_sides import BLOCK_SIZE, Shape, decode_main, endpoints, prefill_main  # noqa: E402

CONFIG = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct/config.json"
SMOLLM = Shape("SmolLM2-135M", 30, 3, 64)
"""Its config.json's figures, for a machine that has no copy of the model."""
LLAMA8B = Shape("Llama-3-8B", 32, 8, 128)
THRESHOLD = 0.8
LAYERWISE_MAX = 0.3


def smollm_shape(config: Path = CONFIG) -> Shape:
    if not config.exists():
        return SMOLLM
    c = json.loads(config.read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    dtype = c.get("dtype") or c.get("torch_dtype") or "bfloat16"
    return Shape("SmolLM2-135M", c["num_hidden_layers"], c["num_key_value_heads"], head_dim, dtype)


class Side:
    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        if not self.conn.poll(300):
            raise RuntimeError(f"{target.__name__} did not start")
        _, self.pid = self.conn.recv()

    def __call__(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(300):
            raise RuntimeError(f"no answer to {cmd[0]}")
        return self.conn.recv()

    def stop(self) -> None:
        self("stop")
        self.proc.join(30)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def measure_shape(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    blocks = math.ceil(args.tokens / BLOCK_SIZE)
    num_blocks = blocks + 16
    nbytes = blocks * BLOCK_SIZE * shape.token_nbytes()
    tcp, ipc = endpoints(args.port)
    prefill = Side(prefill_main, shape, num_blocks, args.device, tcp, ipc)
    decode = Side(decode_main, shape, num_blocks, args.device)
    try:
        return _measure(shape, args, prefill, decode, blocks, nbytes, tcp, ipc)
    finally:
        decode.stop()
        prefill.stop()


def _measure(
    shape: Shape, args: argparse.Namespace, prefill: Side, decode: Side, blocks: int, nbytes: int, tcp: str, ipc: str
) -> dict[str, Any]:
    remote = list(range(1, blocks + 1))  # the prefill's blocks, offset from the decode's
    local = list(range(blocks))
    r = args.repeats
    out: dict[str, Any] = {"shape": shape.__dict__, "tokens": args.tokens, "blocks": blocks, "bytes": nbytes}
    ceil = prefill("ceil", nbytes, r)
    out["ceiling_gbps"] = {k: _gbps(nbytes, v) for k, v in ceil.items()}
    out["d2h_gbps"] = _gbps(nbytes, _median(prefill("d2h", remote, r)))
    out["h2d_gbps"] = _gbps(nbytes, _median(decode("h2d", local, r)))
    want = prefill("sums", remote)
    sums: dict[str, bool] = {}

    decode("zero")
    decode("open", prefill("export"))
    out["ipc_gbps"] = _gbps(nbytes, _median(decode("ipc", remote, local, r)))
    sums["ipc"] = decode("sums", local) == want

    pulls: dict[str, Any] = {}
    for transport, ep in (("shm", ipc), ("tcp", tcp)):
        decode("zero")
        times = []
        for i in range(r):
            prefill("offer", f"{transport}-{i}", remote)
            res = decode("pull", transport, ep, f"{transport}-{i}", remote, local, False)
            if not res["ok"]:
                raise RuntimeError(f"{transport} pull failed: {res['reason']}")
            times.append(res)
        sums[transport] = decode("sums", local) == want
        pull_s = _median([t["pull_s"] for t in times])
        pulls[transport] = {
            "gbps": _gbps(nbytes, pull_s),
            "pull_ms": round(pull_s * 1e3, 3),
            "h2d_ms": round(_median([t["h2d_s"] for t in times]) * 1e3, 3),
        }
        pulls[transport]["fixed_ms"] = _fixed(prefill, decode, transport, ep, args.fixed_repeats)
    out["pulls"] = pulls
    best = min(pulls, key=lambda t: pulls[t]["pull_ms"])
    whole_ms = nbytes / (out["d2h_gbps"] * 1e9) * 1e3 + pulls[best]["pull_ms"] + pulls[best]["h2d_ms"]
    layer_ms = args.layer_ms if args.layer_ms is not None else whole_ms / shape.layers
    out["layerwise"] = _layerwise(prefill, decode, best, ipc if best == "shm" else tcp, remote, local, layer_ms, r)
    sums["layerwise"] = decode("sums", local) == want
    out["checksums_equal"] = sums
    return out


def _fixed(prefill: Side, decode: Side, transport: str, ep: str, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        prefill("offer", f"fx-{transport}-{i}", [0])
        res = decode("pull", transport, ep, f"fx-{transport}-{i}", [0], [0], False)
        if i >= 2:  # two warm-up pulls are not counted
            times.append(res["pull_s"] + res["h2d_s"])
    return round(_median(times) * 1e3, 3)


def _layerwise(
    prefill: Side,
    decode: Side,
    transport: str,
    ep: str,
    remote: list[int],
    local: list[int],
    layer_ms: float,
    repeats: int,
) -> dict[str, Any]:
    """Exposed ms (end of the prefill's compute to every block in the decode cache) of a whole-prompt
    pull and of a layer-wise one; medians of ``repeats``."""
    whole, layered = [], []
    positions = list(range(len(local)))
    for i in range(repeats):
        decode("zero")
        end = prefill("whole", f"wh-{i}", remote, layer_ms)
        res = decode("pull", transport, ep, f"wh-{i}", remote, local, False)
        whole.append((res["end"] - end) * 1e3)
        decode("zero")
        decode.conn.send(("pull", transport, ep, f"lw-{i}", positions, local, True))  # asked before compute
        end = prefill("layerwise", f"lw-{i}", remote, layer_ms)
        res = decode.conn.recv()
        if not res["ok"]:
            raise RuntimeError(f"layer-wise pull failed: {res['reason']}")
        layered.append(max(0.0, res["end"] - end) * 1e3)
    w, lw = _median(whole), _median(layered)
    return {
        "transport": transport,
        "layer_ms": round(layer_ms, 3),
        "whole_exposed_ms": round(w, 3),
        "layerwise_exposed_ms": round(lw, 3),
        "ratio": round(lw / w, 3) if w > 0 else None,
    }


def verdicts(shape_result: dict[str, Any], device: str) -> dict[str, str]:
    """pass / fail / skipped (reason) per acceptance threshold."""
    c = shape_result["ceiling_gbps"]
    gpu_only = "skipped: needs a GPU (on CPU the copies are host memcpy; rehearsal only)"
    out: dict[str, str] = {}
    for name, got, ceiling in (
        ("d2h", shape_result["d2h_gbps"], c["d2h"]),
        ("h2d", shape_result["h2d_gbps"], c["h2d"]),
        ("ipc", shape_result["ipc_gbps"], c["d2d"]),
    ):
        ok = got >= THRESHOLD * ceiling
        out[name] = gpu_only if device == "cpu" else ("pass" if ok else "fail") + f" ({got} vs {ceiling} GB/s)"
    ratio = shape_result["layerwise"]["ratio"]
    out["layerwise"] = ("pass" if ratio is not None and ratio <= LAYERWISE_MAX else "fail") + f" (ratio {ratio})"
    out["checksums"] = "pass" if all(shape_result["checksums_equal"].values()) else "fail"
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the rehearsal)")
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 7500 on CUDA, 1024 on CPU)")
    p.add_argument("--shapes", default="smollm,llama8b", help="comma-separated: smollm, llama8b")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fixed-repeats", type=int, default=20)
    p.add_argument("--layer-ms", type=float, default=None, help="simulated compute per layer (default: measured)")
    p.add_argument("--port", type=int, default=28500)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = 1024 if args.device == "cpu" else 7500
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    started = time.perf_counter()
    shapes = {"smollm": smollm_shape(), "llama8b": LLAMA8B}
    result: dict[str, Any] = {"device": args.device, "rehearsal": args.device == "cpu", "shapes": {}}
    if args.device != "cpu":
        import torch

        result["gpu"] = torch.cuda.get_device_name(args.device)
        result["torch"] = torch.__version__
    for key in args.shapes.split(","):
        shape = shapes[key.strip()]
        r = measure_shape(shape, args)
        r["verdicts"] = verdicts(r, args.device)
        result["shapes"][shape.name] = r
        args.port += 1
        print(f"{shape.name}: {json.dumps(r['verdicts'])}", flush=True)
        if args.out:  # kept after each shape: a run cut short still leaves what it measured
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    result["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    print(result_line(result))
    return result


def result_line(result: dict[str, Any]) -> str:
    first = next(iter(result["shapes"].values()))
    v = [s["verdicts"] for s in result["shapes"].values()]
    failed = any(x.startswith("fail") for s in v for x in s.values())
    lw = first["layerwise"]
    return (
        f"RESULT device={result['device']} rehearsal={str(result['rehearsal']).lower()} "
        f"d2h_gbps={first['d2h_gbps']} h2d_gbps={first['h2d_gbps']} ipc_gbps={first['ipc_gbps']} "
        f"ceil_d2h_gbps={first['ceiling_gbps']['d2h']} ceil_h2d_gbps={first['ceiling_gbps']['h2d']} "
        f"ceil_d2d_gbps={first['ceiling_gbps']['d2d']} shm_gbps={first['pulls']['shm']['gbps']} "
        f"tcp_gbps={first['pulls']['tcp']['gbps']} fixed_shm_ms={first['pulls']['shm']['fixed_ms']} "
        f"fixed_tcp_ms={first['pulls']['tcp']['fixed_ms']} whole_exposed_ms={lw['whole_exposed_ms']} "
        f"layerwise_exposed_ms={lw['layerwise_exposed_ms']} checksums_equal="
        f"{str(all(all(s['checksums_equal'].values()) for s in result['shapes'].values())).lower()} "
        f"verdict={'fail' if failed else 'pass'}"
    )


if __name__ == "__main__":
    main()
