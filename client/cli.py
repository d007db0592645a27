"""``manylora``: command line client of the ManyLoRA GLiNER2 model.

    manylora extract --entities person,company "Tim Cook runs Apple."
    manylora extract --schema schema.json --adapter acme --input in.jsonl --output out.jsonl
    manylora health --url localhost:8001

Input lines: ``{"text": ..., "schema"?: {...}, "adapter"?: "...", "threshold"?: 0.4}``; a
line's own schema, adapter and threshold win over the flags. One output line per
non-empty input line, in input order: ``{"result": ...}`` or
``{"error": {"code": ..., "message": ...}}``.

Exit status: 0 all items succeeded (health: model ready), 1 some item failed
(health: not ready), 2 usage error.

``main`` takes a ``client_factory`` so tests can inject a fake client: it is called
with ``url, protocol, model_name, timeout, concurrency`` keywords and must return an
object with ``stream(items, window)``, ``health()`` and ``close()``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from .client import DEFAULT_CONCURRENCY, ManyLoRAClient
from .errors import ManyLoRAError, SchemaError
from .protocol import DEFAULT_THRESHOLD, MODEL_NAME, Request

EXIT_OK, EXIT_ITEM_FAILED, EXIT_USAGE = 0, 1, 2
LINE_KEYS = {"text", "schema", "adapter", "threshold"}


class UsageError(Exception):
    """Bad command line or flag value: exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.format_usage()}{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="manylora", description="Client of the ManyLoRA GLiNER2 Triton model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def connection(sub):
        sub.add_argument("--url", help="HOST:PORT (default localhost:8001 gRPC, localhost:8000 HTTP)")
        sub.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
        sub.add_argument("--model", default=MODEL_NAME, help="Triton model name (default %(default)s)")
        sub.add_argument("--timeout", type=_positive_float, help="seconds per request")

    extract = commands.add_parser(
        "extract",
        help="run GLiNER2 extraction on a text or a JSONL file",
        description="Run GLiNER2 extraction on TEXT or on every line of --input.",
    )
    connection(extract)
    schema = extract.add_mutually_exclusive_group()
    schema.add_argument("--schema", metavar="FILE_OR_JSON", help="GLiNER2 schema dict (Schema.from_dict form)")
    schema.add_argument("--entities", metavar="A,B,C", help="entity types, as extract_entities")
    schema.add_argument("--classify", metavar="FILE_OR_JSON", help="tasks dict, as classify_text")
    schema.add_argument("--relations", metavar="A,B", help="relation types, as extract_relations")
    schema.add_argument("--json", metavar="FILE_OR_JSON", help="structures dict, as extract_json")
    extract.add_argument("--adapter", default="", help="LoRA adapter id (default: base model)")
    extract.add_argument("--threshold", type=_unit_float, default=DEFAULT_THRESHOLD)
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
    source.add_argument("--input", metavar="FILE", help="JSONL input, - for stdin")
    extract.add_argument("--output", metavar="FILE", help="JSONL output (default stdout); needs --input")

    health = commands.add_parser("health", help="check that the server and the model are ready")
    connection(health)
    return parser


def main(
    argv: list | None = None,
    *,
    client_factory: Callable[..., Any] | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    try:
        args = build_parser().parse_args(argv)
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


def read_requests(lines: Iterable[str], defaults: dict) -> Iterator[Request | ManyLoRAError]:
    """One Request per non-empty JSONL line, or a ManyLoRAError (INVALID_ARG) for a bad line."""
    from . import schemas

    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise ValueError(f"expected a JSON object, got {type(item).__name__}")
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
            yield Request(
                text=item["text"],
                schema=schema_json,
                adapter=defaults["adapter"] if adapter is None else adapter,
                threshold=item.get("threshold", defaults["threshold"]),
                include_confidence=defaults["include_confidence"],
                include_spans=defaults["include_spans"],
            )
        except ValueError as err:  # JSONDecodeError and SchemaError are ValueErrors
            yield ManyLoRAError(f"line {number}: {err}", "INVALID_ARG")


def write_answers(answers: Iterable[dict | ManyLoRAError], out: TextIO, progress=None) -> tuple:
    """Write one JSONL line per answer; return (items written, items failed)."""
    written = failed = 0
    for answer in answers:
        written += 1
        if isinstance(answer, ManyLoRAError):
            failed += 1
            record = {"error": answer.to_json()}
        else:
            record = {"result": answer}
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

    total = None
    if args.input == "-":
        source = stdin
    else:
        try:
            source = open(args.input, encoding="utf-8")
        except OSError as err:
            raise UsageError(f"manylora extract: error: --input: {err}") from None
        with open(args.input, encoding="utf-8") as count_pass:
            total = sum(1 for line in count_pass if line.strip())
    try:
        sink = stdout if args.output in (None, "-") else open(args.output, "w", encoding="utf-8")
    except OSError as err:
        source.close()
        raise UsageError(f"manylora extract: error: --output: {err}") from None
    try:
        with tqdm(total=total, unit="req", file=stderr, disable=None, dynamic_ncols=True) as progress:
            answers = client.stream(read_requests(source, defaults), window=args.concurrency)
            written, failed = write_answers(answers, sink, progress)
    finally:
        if source is not stdin:
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


def _unit_float(value: str) -> float:
    number = _number(value, float)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {value}")
    return number


def _positive_int(value: str) -> int:
    number = _number(value, int)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


if __name__ == "__main__":
    sys.exit(main())
