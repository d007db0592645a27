"""What one request costs a Python-backend stub, by rows per request: the premise of BLS
against an ensemble (docs/architecture.md, "BLS rather than an ensemble").

    python perf/bench_stub_costs.py [--rows 1 16 28 64] [--calls 300]

The GPU stage is one stub process whose interpreter lock bounds the pipeline at saturation.
With BLS it gets one request per front batch (28 client requests at the H200's saturation);
a Triton ensemble would hand it one request per client request. This starts a real
tritonserver with two models and no engine: ``core_like`` has the GPU stage's inputs and
outputs (``manylora.wire``: 7 tensors in, 2 out, the same dtypes) and only reads its inputs and
answers with outputs of the real sizes; ``caller`` sends it BLS requests of N rows, as a front
does. Printed per N: the callee's CPU per request and per row (its ``execute`` thread, as
``time.thread_time`` sees it: the stub's Python glue and tensor handling, not what the
C++ side of the stub does on its own threads) and the caller's CPU and wall per call.
Our own per-row parse and pack are not in it (``perf/bench_host_steps.py`` times them).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from manylora.wire import CORE_INPUTS, CORE_OUTPUTS  # noqa: E402

_TYPES = {"SCHEMA": "TYPE_STRING", "ADAPTER_ID": "TYPE_STRING", "T_MIN": "TYPE_FP32"}

CALLEE = """
import time
import numpy as np
import triton_python_backend_utils as pb

NAMES = {inputs!r}


class TritonPythonModel:
    def initialize(self, args):
        self.cpu, self.requests = 0.0, 0

    def execute(self, requests):
        started = time.thread_time()
        out = []
        for request in requests:
            arrays = [pb.get_input_tensor_by_name(request, n).as_numpy() for n in NAMES]
            rows = arrays[1].size
            status = np.array([[b""] * rows], dtype=np.object_)
            compact = np.array([[b"x" * (64 * rows)]], dtype=np.object_)  # ~a row's packed hits
            took = np.array([[self.cpu, self.requests]], dtype=np.float64)
            tensors = [pb.Tensor({outputs[0]!r}, status), pb.Tensor({outputs[1]!r}, compact), pb.Tensor("TOOK", took)]
            out.append(pb.InferenceResponse(output_tensors=tensors))
        self.cpu += time.thread_time() - started
        self.requests += len(requests)
        return out
"""

CALLER = """
import json
import time
import numpy as np
import triton_python_backend_utils as pb

NAMES = {inputs!r}
OUTPUTS = {outputs!r}


def inputs(rows):
    ids = (np.arange(rows * 120, dtype=np.int32) % 1000).reshape(1, -1)
    counts = np.full((1, rows), 120, dtype=np.int32)
    words = np.arange(rows * 90, dtype=np.int32).reshape(1, -1)
    schema = np.array([[b'{{"entities": ["company", "location", "date", "product", "event"]}}'] * rows], dtype=np.object_)
    adapter = np.array([[b"adapter-00001"] * rows], dtype=np.object_)
    t_min = np.full((1, rows), 0.5, dtype=np.float32)
    return dict(zip(NAMES, (ids, counts, words, np.full((1, rows), 90, dtype=np.int32), schema, adapter, t_min)))


def request(arrays, outputs):
    tensors = [pb.Tensor(n, a) for n, a in arrays.items()]
    return pb.InferenceRequest(model_name="core_like", inputs=tensors, requested_output_names=outputs)


def took(arrays):
    answer = request(arrays, ["TOOK"]).exec()
    return pb.get_output_tensor_by_name(answer, "TOOK").as_numpy().reshape(-1)


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for req in requests:
            config = json.loads(pb.get_input_tensor_by_name(req, "CONFIG").as_numpy().reshape(-1)[0])
            lines = []
            for rows in config["rows"]:
                arrays = inputs(rows)
                for _ in range(20):  # warm-up
                    request(arrays, list(OUTPUTS)).exec()
                before = took(arrays)
                wall, cpu = time.perf_counter(), time.thread_time()
                for _ in range(config["calls"]):
                    answer = request(arrays, list(OUTPUTS)).exec()
                    for name in OUTPUTS:
                        pb.get_output_tensor_by_name(answer, name).as_numpy()
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                after = took(arrays)
                callee = (after[0] - before[0]) / (after[1] - before[1])  # the first TOOK call is counted too
                calls = config["calls"]
                lines.append(dict(rows=rows, callee_requests=int(after[1] - before[1]),
                                  callee_cpu_us=callee * 1e6, callee_cpu_us_per_row=callee * 1e6 / rows,
                                  caller_cpu_us=cpu / calls * 1e6, caller_wall_us=wall / calls * 1e6))
            result = np.array([json.dumps(lines).encode()], dtype=np.object_)
            out.append(pb.InferenceResponse(output_tensors=[pb.Tensor("RESULT", result)]))
        return out
"""


def _io(name: str, kind: str) -> str:
    return f'{{ name: "{name}" data_type: {kind} dims: [ -1 ] }}'


def write_repository(root: Path) -> None:
    core, caller = root / "core_like", root / "caller"
    (core / "1").mkdir(parents=True)
    (caller / "1").mkdir(parents=True)
    inputs = ",\n  ".join(
        _io(n, _TYPES.get(n, "TYPE_INT32")).replace(" }", " allow_ragged_batch: true }") for n in CORE_INPUTS
    )
    outputs = ",\n  ".join([_io(n, "TYPE_STRING") for n in CORE_OUTPUTS] + [_io("TOOK", "TYPE_FP64")])
    (core / "config.pbtxt").write_text(
        f'name: "core_like"\nbackend: "python"\nmax_batch_size: 64\n'
        f"dynamic_batching {{ max_queue_delay_microseconds: 0 }}\n"
        f"input [\n  {inputs}\n]\noutput [\n  {outputs}\n]\ninstance_group [ {{ count: 1 kind: KIND_CPU }} ]\n"
    )
    (caller / "config.pbtxt").write_text(
        'name: "caller"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "CONFIG" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "RESULT" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    )
    names = dict(inputs=CORE_INPUTS, outputs=CORE_OUTPUTS)
    (core / "1" / "model.py").write_text(textwrap.dedent(CALLEE.format(**names)))
    (caller / "1" / "model.py").write_text(textwrap.dedent(CALLER.format(**names)))


def measure(rows: list[int], calls: int) -> list[dict]:
    """One line per entry of ``rows``: the costs above (a tritonserver started and stopped here)."""
    import numpy as np
    import tritonclient.http as http

    from manylora.tritonserver import TritonServer

    with tempfile.TemporaryDirectory(prefix="stub-costs-") as tmp:
        repo = Path(tmp) / "repo"
        write_repository(repo)
        with TritonServer(repo, log_file=Path(tmp) / "server.log") as server:
            client = http.InferenceServerClient(server.http_url.removeprefix("http://"), network_timeout=900)
            config = http.InferInput("CONFIG", [1], "BYTES")
            config.set_data_from_numpy(
                np.array([json.dumps({"rows": rows, "calls": calls}).encode()], dtype=np.object_)
            )
            return json.loads(client.infer("caller", [config]).as_numpy("RESULT")[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 28, 64])
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    print("rows/request  callee CPU us/request  callee CPU us/row  caller CPU us/call  caller wall us/call")
    for line in measure(args.rows, args.calls):
        print(
            f"{line['rows']:>12}  {line['callee_cpu_us']:>21.1f}  {line['callee_cpu_us_per_row']:>17.1f}"
            f"  {line['caller_cpu_us']:>18.1f}  {line['caller_wall_us']:>19.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
