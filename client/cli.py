"""``manylora``: command line client of the ManyLoRA GLiNER2 model.

    manylora extract --entities person,company "Tim Cook runs Apple."
    manylora extract --schema schema.json --adapter acme --input in.jsonl --output out.jsonl
    cat in.jsonl | manylora extract --entities person --input -
    manylora health --url localhost:8001
    manylora control list | preload ID... | evict ID... | stats
    manylora --version

Input lines: ``{"text": ..., "schema"?: {...}, "adapter"?: "...", "threshold"?: 0.4, "id"?: ...}``;
a line's own schema, adapter and threshold win over the flags. The input is read once, line
by line (a pipe or a FIFO works; nothing is read twice). One output line per non-empty input
line, in input order: ``{"result": ...}`` or ``{"error": {"code": ..., "message": ...}}``,
with the line's ``id`` (any JSON value) first when it has one. A line that is not UTF-8 or
not JSON gets an INVALID_ARG error record of its own; the other lines are answered.

Exit status: 0 all items succeeded (health: model ready; control: every instance answered
and nothing was refused), 1 some item failed (health: not ready; control: the command, an
adapter or an instance was refused, failed or did not answer), 2 usage error, 3 (control) the
server cannot be reached or does not serve adapter control.

``main`` takes a ``client_factory`` so tests can inject a fake client: it is called
with ``url, protocol, model_name, timeout, concurrency`` keywords and must return an
object with ``stream(items, window)``, ``health()`` and ``close()``; and a
``control_sender`` standing in for ``manylora.control.send``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from manylora import control

from .client import DEFAULT_CONCURRENCY, ManyLoRAClient
from .errors import ManyLoRAError, SchemaError
from .protocol import DEFAULT_THRESHOLD, MODEL_NAME, Request, wire_threshold

EXIT_OK, EXIT_ITEM_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, control.EXIT_UNREACHABLE
LINE_KEYS = {"text", "schema", "adapter", "threshold", "id"}
FALLBACK_VERSION = "0.1.0"  # when the package is not installed (run from a checkout)
NO_ID = object()  # an input line without an "id"
EXIT_STATUS_HELP = """exit status:
  0  every item succeeded (health: the model is ready; control: every instance answered, nothing refused)
  1  some item failed (health: not ready; control: the server refused the command, or an adapter was
     refused or skipped, or an instance failed or did not answer in time)
  2  usage error
  3  control: the server cannot be reached, does not serve manylora_control, or no instance answers it"""


def package_version() -> str:
    """The installed manylora distribution's version; FALLBACK_VERSION when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("manylora")
    except metadata.PackageNotFoundError:
        return FALLBACK_VERSION


class UsageError(Exception):
    """Bad command line or flag value: exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.format_usage()}{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="manylora",
        description="Client of the ManyLoRA GLiNER2 Triton model.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"manylora {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def connection(sub):
        sub.add_argument("--url", help="HOST:PORT (default localhost:8001 gRPC, localhost:8000 HTTP)")
        sub.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
        sub.add_argument("--model", default=MODEL_NAME, help="Triton model name (default %(default)s)")
        sub.add_argument("--timeout", type=_positive_float, help="seconds per request")

    extract = commands.add_parser(
        "extract",
        help="run GLiNER2 extraction on a text or a JSONL file",
        description="Run GLiNER2 extraction on TEXT or on every line of --input (read once: pipes and\n"
        'FIFOs work). Input lines: {"text", "schema"?, "adapter"?, "threshold"?, "id"?};\n'
        'output lines, in input order: {"id"?, "result"} or {"id"?, "error": {"code", "message"}}.',
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    connection(extract)
    schema = extract.add_mutually_exclusive_group()
    schema.add_argument("--schema", metavar="FILE_OR_JSON", help="GLiNER2 schema dict (Schema.from_dict form)")
    schema.add_argument("--entities", metavar="A,B,C", help="entity types, as extract_entities")
    schema.add_argument("--classify", metavar="FILE_OR_JSON", help="tasks dict, as classify_text")
    schema.add_argument("--relations", metavar="A,B", help="relation types, as extract_relations")
    schema.add_argument("--json", metavar="FILE_OR_JSON", help="structures dict, as extract_json")
    extract.add_argument("--adapter", default="", help="LoRA adapter id (default: base model)")
    extract.add_argument("--threshold", type=_threshold, default=DEFAULT_THRESHOLD)
    extract.add_argument("--confidence", action="store_true", help="include confidence scores")
    extract.add_argument("--spans", action="store_true", help="include character spans")
    extract.add_argument(
        "--concurrency",
        type=_positive_int,
        default=DEFAULT_CONCURRENCY,
        help="requests in flight (default %(default)s)",
    )
    source = extract.add_mutually_exclusive_group(required=True)
    source.add_argument("text", nargs="?", metavar="TEXT", help="text to extract from")
    source.add_argument("--input", metavar="FILE", help="JSONL input (a file, a FIFO, or - for stdin)")
    extract.add_argument("--output", metavar="FILE", help="JSONL output (default stdout); needs --input")

    health = commands.add_parser("health", help="check that the server and the model are ready")
    connection(health)

    steer = commands.add_parser(
        "control",
        help="list, preload, evict adapters or read cache stats (the manylora_control model)",
        description="Send one adapter-control command to every gliner2_core instance through the\n"
        "manylora_control model and print its JSON answer.\n"
        "  list           adapters on disk; what each instance holds, and the tensors PEFT ignores\n"
        "  preload ID...  load into host memory, then GPU slots\n"
        "  evict ID...    forget in both tiers\n"
        "  stats          cache counters and memory",
        epilog=control.EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    control.add_control_arguments(steer)
    return parser


def main(
    argv: list | None = None,
    *,
    client_factory: Callable[..., Any] | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    control_sender: Callable[..., dict] | None = None,
) -> int:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    try:
        try:
            with contextlib.redirect_stdout(stdout):  # --help and --version print there
                args = build_parser().parse_args(argv)
        except SystemExit as done:  # --help, --version
            return done.code if isinstance(done.code, int) else EXIT_OK
        if args.command == "extract":
            schema_json = schema_from_flags(args)
            if args.output is not None and args.input is None:
                raise UsageError("manylora extract: error: --output needs --input")
            if args.text is not None and schema_json is None:
                raise UsageError(
                    "manylora extract: error: give a schema: --schema, --entities, --classify, --relations or --json"
                )
    except UsageError as err:
        print(err, file=stderr)
        return EXIT_USAGE

    if args.command == "control":
        return control.run_command(
            args.action,
            args.adapter_ids,
            url=args.url,
            protocol=args.protocol,
            model=args.model,
            timeout=args.timeout,
            stdout=stdout,
            stderr=stderr,
            sender=control_sender or control.send,
        )
    client_factory = client_factory or ManyLoRAClient
    try:
        client = client_factory(
            url=args.url,
            protocol=args.protocol,
            model_name=args.model,
            timeout=args.timeout,
            concurrency=getattr(args, "concurrency", 1),
        )
    except ValueError as err:  # e.g. a URL with a scheme
        print(f"manylora: error: {err}", file=stderr)
        return EXIT_USAGE
    try:
        if args.command == "health":
            return run_health(client, stdout)
        defaults = dict(
            schema=schema_json,
            adapter=args.adapter,
            threshold=args.threshold,
            include_confidence=args.confidence,
            include_spans=args.spans,
        )
        if args.text is not None:
            return run_text(client, args.text, defaults, stdout, stderr)
        return run_file(client, args, defaults, stdin, stdout, stderr)
    except UsageError as err:
        print(err, file=stderr)
        return EXIT_USAGE
    finally:
        client.close()


def schema_from_flags(args) -> str | None:
    """The SCHEMA JSON the flags ask for, built once; None when no schema flag is given."""
    from . import schemas

    try:
        if args.schema is not None:
            return schemas.encode_schema(load_json_arg(args.schema, "--schema"))
        if args.entities is not None:
            return schemas.encode_schema(schemas.entities_schema(_names(args.entities, "--entities")))
        if args.relations is not None:
            return schemas.encode_schema(schemas.relations_schema(_names(args.relations, "--relations")))
        if args.classify is not None:
            tasks = load_json_arg(args.classify, "--classify")
            if not isinstance(tasks, dict):
                raise UsageError("--classify must be a JSON object: task -> labels")
            return schemas.encode_schema(schemas.classification_schema(tasks))
        if args.json is not None:
            structures = load_json_arg(args.json, "--json")
            if not isinstance(structures, dict):
                raise UsageError("--json must be a JSON object: structure -> field specs")
            return schemas.encode_schema(schemas.json_schema(structures))
    except (SchemaError, ValueError, TypeError, AttributeError) as err:
        raise UsageError(f"manylora extract: error: bad schema: {err}") from err
    return None


def load_json_arg(value: str, flag: str) -> Any:
    """A flag value that is a JSON document or the path of a file holding one."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            text, where = handle.read(), value
    else:
        text, where = value, "the argument"
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        hint = "" if where != "the argument" else " (and no such file)"
        raise UsageError(f"manylora extract: error: {flag}: {where} is not valid JSON{hint}: {err}") from None


def read_requests(
    lines: Iterable[str | bytes], defaults: dict, ids: deque | None = None
) -> Iterator[Request | ManyLoRAError]:
    """One Request per non-empty JSONL line, or a ManyLoRAError (INVALID_ARG) for a bad line:
    bytes that are not UTF-8, not JSON, not an object, or not a request.

    ``lines`` may be bytes (decoded here, line by line) or str. With ``ids``, the ``id`` of each
    line (``NO_ID`` when it has none, or is not a JSON object) is appended to it as the line is
    yielded, for write_answers.
    """
    from . import schemas

    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        line_id = NO_ID
        try:
            if isinstance(line, bytes):
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    bad = err.object[err.start : err.start + 1].hex()
                    raise ValueError(f"not valid UTF-8 (byte 0x{bad} at position {err.start}: {err.reason})") from None
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte order mark
            try:
                item = json.loads(line)
            except RecursionError:
                raise ValueError("not valid JSON: nested too deeply") from None
            except json.JSONDecodeError as err:
                raise ValueError(f"not valid JSON: {err}") from None
            if not isinstance(item, dict):
                raise ValueError(f"expected a JSON object, got {type(item).__name__}")
            line_id = item.get("id", NO_ID)
            unknown = set(item) - LINE_KEYS
            if unknown:
                raise ValueError(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(LINE_KEYS)}")
            if "text" not in item:
                raise ValueError('missing "text"')
            if "schema" in item:
                schema_json = schemas.encode_schema(item["schema"])
            elif defaults["schema"] is not None:
                schema_json = defaults["schema"]
            else:
                raise ValueError('no "schema" on the line and no schema flag given')
            adapter = item.get("adapter")
            request = Request(
                text=item["text"],
                schema=schema_json,
                adapter=defaults["adapter"] if adapter is None else adapter,
                threshold=item.get("threshold", defaults["threshold"]),
                include_confidence=defaults["include_confidence"],
                include_spans=defaults["include_spans"],
            )
        except ValueError as err:  # JSONDecodeError and SchemaError are ValueErrors
            request = ManyLoRAError(f"line {number}: {err}", "INVALID_ARG")
        if ids is not None:
            ids.append(line_id)
        yield request


def write_answers(
    answers: Iterable[dict | ManyLoRAError], out: TextIO, progress=None, ids: deque | None = None
) -> tuple:
    """Write one JSONL line per answer (with the ``id`` from ``ids``, in order, when the input
    line had one); return (items written, items failed)."""
    written = failed = 0
    for answer in answers:
        written += 1
        record: dict[str, Any] = {}
        if ids:
            line_id = ids.popleft()
            if line_id is not NO_ID:
                record["id"] = line_id
        if isinstance(answer, ManyLoRAError):
            failed += 1
            record["error"] = answer.to_json()
        else:
            record["result"] = answer
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        if progress is not None:
            progress.update(1)
    return written, failed


def run_text(client, text: str, defaults: dict, stdout: TextIO, stderr: TextIO) -> int:
    try:
        request = Request(text=text, **defaults)
    except ValueError as err:
        raise UsageError(f"manylora extract: error: {err}") from err
    (answer,) = list(client.stream([request], window=1))
    if isinstance(answer, ManyLoRAError):
        answer.index = None
        print(f"manylora: {answer}", file=stderr)
        return EXIT_ITEM_FAILED
    print(json.dumps(answer, ensure_ascii=False, indent=2), file=stdout)
    return EXIT_OK


def run_file(client, args, defaults: dict, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    from tqdm import tqdm

    # one pass, as bytes: a pipe or FIFO is read once, and each line is decoded on its own
    if args.input == "-":
        source = getattr(stdin, "buffer", stdin)
    else:
        try:
            source = open(args.input, "rb")
        except OSError as err:
            raise UsageError(f"manylora extract: error: --input: {err}") from None
    try:
        sink = stdout if args.output in (None, "-") else open(args.output, "w", encoding="utf-8")
    except OSError as err:
        if args.input != "-":
            source.close()
        raise UsageError(f"manylora extract: error: --output: {err}") from None
    ids: deque = deque()
    try:
        with tqdm(unit="req", file=stderr, disable=None, dynamic_ncols=True) as progress:
            answers = client.stream(read_requests(source, defaults, ids), window=args.concurrency)
            written, failed = write_answers(answers, sink, progress, ids)
    finally:
        if args.input != "-":
            source.close()
        if sink is not stdout:
            sink.close()
    if failed:
        print(f"manylora: {failed} of {written} item(s) failed", file=stderr)
        return EXIT_ITEM_FAILED
    return EXIT_OK


def run_health(client, stdout: TextIO) -> int:
    report = client.health()
    print(json.dumps(report), file=stdout)
    return EXIT_OK if report.get("model_ready") else EXIT_ITEM_FAILED


def _names(value: str, flag: str) -> list:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise UsageError(f"manylora extract: error: {flag} needs at least one name")
    return names


def _number(value: str, kind: type):
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {value!r}") from None


def _positive_float(value: str) -> float:
    number = _number(value, float)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def _threshold(value: str) -> float:
    """Any number, as GLiNER2's threshold (above 1 and NaN find nothing, below 0 acts as 0)."""
    number = _number(value, float)
    try:
        return wire_threshold(number)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(value: str) -> int:
    number = _number(value, int)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


if __name__ == "__main__":
    sys.exit(main())
