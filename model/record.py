"""What a conversion writes about itself, as types: one strict reader and one writer each.

Two records:
  conversion.json         `ConversionRecord`: tool and table (its `TableIdentity`: name,
                          version, target, drafter, runtime versions and class), the source (its name, commit,
                          the sizes of the files read and the sha256 of its config.json), a
                          digest of the conversion's fingerprint (the up-to-date test), the
                          config fields the runtimes read, and every tensor's file, size and
                          sha256.
  config.json's `dsv4_convert`   `LayoutRecord`: the layout, table and version a `--target
                          xpu` output was converted with (a draft directory's config.json is
                          the source's, byte for byte, and has none).

Every reader (the converter's up-to-date test, the output-safety check, `check`, `batch`,
`--reverse`, the model loader) goes through `ConversionRecord.from_json` / `read` and
`LayoutRecord.of`; anything malformed is a `RecordError` naming the field, which each reader
turns into its own verdict (check: exit 73/74/75; the converter: "not an output of this
tool"). It lives in model/ so that the model loader can read it too.

Nothing here records where the source lay on this machine: a local source is named by its
directory's name only, so a pushed output publishes no home directory. The full fingerprint
(absolute path, modification times), which a resumed run compares, stays in the partial
directory's state file and never reaches OUT.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.model import strictjson

TOOL = "dsv4-convert"  # conversion.json's "tool": what marks a directory as this tool's output
CONVERSION_RECORD = "conversion.json"
LAYOUT_RECORD = "dsv4_convert"  # the key of the layout record in a converted config.json
SHA256 = re.compile(r"[0-9a-f]{64}")  # hashlib's hexdigest
DIRECTIONS = ("forward", "reverse")
# config.json fields that the serving runtimes (mapping/targets/draft.toml) read from a draft's
# config.json or build the draft from: recorded so `check` can name one that changed
RUNTIME_CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "num_hidden_layers",
    "num_nextn_predict_layers",
    "n_routed_experts",
    "expert_dtype",
    "hidden_size",
    "vocab_size",
    "compress_ratios",
    "quantization_config",
    "dspark_block_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
)


class RecordError(ValueError):
    """A record that is not what this tool writes; `field` is the offending field's path
    (e.g. "tensors['x'].nbytes"), `sha256` whether it is a tensor's checksum."""

    def __init__(self, where: str, field: str, message: str, *, sha256: bool = False) -> None:
        super().__init__(f"{where}: {message}")
        self.field = field
        self.sha256 = sha256


ABSENT = "(absent)"  # how a one-line reason shows a field one side lacks


def brief(value: Any) -> str:
    """A value quoted in a one-line reason, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON's true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TableIdentity:
    """The table an output was made with, as conversion.json and `plan --json` write it (these
    field names are their keys): its name and version, the target (`native` for a reverse
    conversion), the drafter kind, and the runtime versions and class its layout is for."""

    table: str
    table_version: str
    target: str
    drafter: str = "mtp"
    runtime: str = ""
    runtime_class: str = ""

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


IDENTITY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TableIdentity)}


class Identified:
    """Plan and ConversionRecord: the table fields their readers name, from one `identity`."""

    identity: TableIdentity

    @property
    def table(self) -> str:
        return self.identity.table

    @property
    def table_version(self) -> str:
        return self.identity.table_version

    @property
    def target(self) -> str:
        return self.identity.target


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """The digest conversion.json keeps of a conversion's fingerprint: equal fingerprints,
    equal digests, and the local paths and times inside stay unpublished."""
    return sha256_hex(strictjson.json_bytes(fingerprint))


@dataclass(frozen=True)
class TensorEntry:
    file: str
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class SourceRecord:
    """The source as published: `location` is a hub repo (`hub:org/name`) or a local
    directory's name (never its path), `revision` the hub commit (None locally), `files`
    the size of each file read, `config_sha256` the sha256 of its config.json."""

    location: str
    revision: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    config_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "revision": self.revision,
            "files": dict(self.files),
            "config_sha256": self.config_sha256,
        }

    @classmethod
    def from_json(cls, value: Any, where: str) -> SourceRecord:
        if not isinstance(value, dict):
            raise RecordError(where, "source", f"source is {brief(value)}, not an object")
        location, revision, files, digest = (
            value.get("location"),
            value.get("revision"),
            value.get("files", {}),
            value.get("config_sha256"),
        )
        if not isinstance(location, str):
            raise RecordError(where, "source.location", f"source.location is {brief(location)}, not a string")
        if revision is not None and not isinstance(revision, str):
            raise RecordError(where, "source.revision", f"source.revision is {brief(revision)}, not a commit")
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and is_int(v) and v >= 0 for k, v in files.items()
        ):
            raise RecordError(where, "source.files", f"source.files is {brief(files)}, not file names and sizes")
        if digest is not None and not (isinstance(digest, str) and SHA256.fullmatch(digest)):
            raise RecordError(
                where, "source.config_sha256", f"source.config_sha256 is {brief(digest)}, not 64 lowercase hex digits"
            )
        return cls(location, revision, dict(files), digest)


@dataclass(frozen=True)
class ConversionRecord(Identified):
    """conversion.json. `config` says what the output's config.json is: "record" (the
    source's plus the `dsv4_convert` layout record) or "source" (the source's bytes)."""

    tool_version: str
    direction: str
    identity: TableIdentity
    source: SourceRecord
    fingerprint: str
    tensors: dict[str, TensorEntry]
    config: str = "record"
    skipped: int = 0
    config_fields: dict[str, Any] = field(default_factory=dict)
    tool: str = TOOL
    # a draft made for a serving target (--serve-with): the target, the route, and the files
    # under OUT/serve/ with their sha256 ("files"); None for any other conversion
    serve: dict[str, Any] | None = None

    @property
    def has_layout_record(self) -> bool:
        """Whether the output's config.json carries the `dsv4_convert` layout record (a
        forward conversion to a layout with renamed tensors; not a reverse conversion, not a
        draft directory)."""
        return self.direction == "forward" and self.config == "record"

    @property
    def files(self) -> set[str]:
        return {e.file for e in self.tensors.values()}

    @property
    def serve_files(self) -> set[str]:
        """The files under OUT/serve/ the conversion wrote (paths relative to OUT)."""
        files = self.serve.get("files") if self.serve is not None else None
        return set(files) if isinstance(files, dict) else set()

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "tool_version": self.tool_version,
            "direction": self.direction,
            **self.identity.to_json(),
            "config": self.config,
            "source": self.source.to_json(),
            "fingerprint": self.fingerprint,
            "skipped": self.skipped,
            "config_fields": self.config_fields,
            "tensors": {
                name: {"file": e.file, "nbytes": e.nbytes, "sha256": e.sha256} for name, e in self.tensors.items()
            },
            **({"serve": self.serve} if self.serve is not None else {}),
        }

    def write(self, directory: Path) -> None:
        strictjson.write_record(directory / CONVERSION_RECORD, self.to_json())

    @classmethod
    def from_json(cls, value: Any, where: str, *, sha256: bool = True) -> ConversionRecord:
        """The record `value` (parsed JSON) holds, or RecordError naming the first field
        that is not what this tool writes. Tensor entries are checked first (file, nbytes,
        then sha256), the fields `check` reports on; with sha256=False a checksum is not
        looked at (`check` reports a malformed one in its checksums check, and --fast
        skips that)."""
        if not isinstance(value, dict) or not isinstance(value.get("tensors"), dict):
            raise RecordError(where, "tensors", "has no 'tensors' object")
        tensors: dict[str, TensorEntry] = {}
        for name, entry in value["tensors"].items():
            at = f"tensors[{name!r}]"
            if not isinstance(entry, dict):
                raise RecordError(where, at, f"{at} is {brief(entry)}, not an object with file, nbytes and sha256")
            if not isinstance(entry.get("file"), str):
                raise RecordError(where, f"{at}.file", f"{at}.file is {brief(entry.get('file'))}, not a file name")
            if not is_int(entry.get("nbytes")):
                raise RecordError(
                    where, f"{at}.nbytes", f"{at}.nbytes is {brief(entry.get('nbytes'))}, not a byte count"
                )
        for name, entry in value["tensors"].items():
            sha = entry.get("sha256")
            if not (isinstance(sha, str) and SHA256.fullmatch(sha)) and sha256:
                at = f"tensors[{name!r}].sha256"
                raise RecordError(where, at, f"{at} is {brief(sha)}, not 64 lowercase hex digits", sha256=True)
            tensors[name] = TensorEntry(entry["file"], entry["nbytes"], sha if isinstance(sha, str) else "")
        if value.get("tool") != TOOL:
            raise RecordError(where, "tool", f"tool is {brief(value.get('tool'))}, not {TOOL!r}")
        strings = {}
        if isinstance(value.get("fingerprint"), dict):  # a record written before the digest: the same digest
            value = {**value, "fingerprint": fingerprint_digest(value["fingerprint"])}
        # in this order, so a record with several bad fields names the same one as ever
        for key, default in (
            ("tool_version", None),
            ("direction", None),
            ("table", None),
            ("table_version", None),
            ("target", None),
            ("fingerprint", None),
            *((k, v) for k, v in IDENTITY_DEFAULTS.items() if v is not dataclasses.MISSING),
            ("config", "record"),
        ):
            v = value.get(key, default)
            if not isinstance(v, str):
                raise RecordError(where, key, f"{key} is {brief(v)}, not a string")
            strings[key] = v
        if strings["direction"] not in DIRECTIONS:
            raise RecordError(
                where, "direction", f"direction is {brief(strings['direction'])}, not one of {DIRECTIONS}"
            )
        skipped, fields = value.get("skipped", 0), value.get("config_fields", {})
        if not is_int(skipped):
            raise RecordError(where, "skipped", f"skipped is {brief(skipped)}, not a count")
        if not isinstance(fields, dict):
            raise RecordError(where, "config_fields", f"config_fields is {brief(fields)}, not an object")
        source = SourceRecord.from_json(value.get("source"), where)
        serve = value.get("serve")
        if serve is not None and not isinstance(serve, dict):
            raise RecordError(where, "serve", f"serve is {brief(serve)}, not an object")
        return cls(
            strings["tool_version"],
            strings["direction"],
            TableIdentity(**{k: strings[k] for k in IDENTITY_DEFAULTS}),
            source,
            strings["fingerprint"],
            tensors,
            strings["config"],
            skipped,
            fields,
            serve=serve,
        )

    @classmethod
    def read(cls, directory: Path, *, sha256: bool = True) -> ConversionRecord:
        """DIRECTORY/conversion.json, read strictly (from_json): FileNotFoundError when
        absent, OSError when unreadable (a FIFO, too large), RecordError for anything malformed."""
        path = directory / CONVERSION_RECORD
        try:
            value = strictjson.loads(strictjson.read_record_bytes(path))
        except strictjson.StrictJSONError as exc:
            raise RecordError(
                str(path), "", f"not strict JSON ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
        return cls.from_json(value, str(path), sha256=sha256)

    @classmethod
    def find(cls, directory: Path) -> ConversionRecord | None:
        """DIRECTORY/conversion.json when it is one this tool wrote; None when it is absent,
        unreadable or malformed (such a file records nothing)."""
        try:
            return cls.read(directory)
        except (OSError, RecordError):
            return None


def runtime_config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The runtime-read fields (RUNTIME_CONFIG_FIELDS) `config` has, as it has them."""
    return {k: config[k] for k in RUNTIME_CONFIG_FIELDS if k in config}


@dataclass(frozen=True)
class LayoutRecord:
    """config.json's `dsv4_convert`: what a renamed-layout output was converted with.
    `quantization_config` is the note of a rewritten compressed-tensors config (its source
    config, for `--reverse`)."""

    layout: str
    table: str
    table_version: str
    tool_version: str
    quantization_config: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layout": self.layout,
            "table": self.table,
            "table_version": self.table_version,
            "tool_version": self.tool_version,
        }
        if self.quantization_config is not None:
            out["quantization_config"] = self.quantization_config
        return out

    @classmethod
    def of(cls, config: dict[str, Any], where: str) -> LayoutRecord | None:
        """The layout record of parsed config.json `config`; None when it has none,
        RecordError when it has one that is not what this tool writes."""
        value = config.get(LAYOUT_RECORD)
        if value is None:
            return None
        keys = ("layout", "table", "table_version", "tool_version")
        if not isinstance(value, dict) or not all(k in value for k in keys):
            raise RecordError(
                where,
                LAYOUT_RECORD,
                f"no {LAYOUT_RECORD} record with {', '.join(keys)}: not a checkpoint this converter wrote",
            )
        for k in keys:
            if not isinstance(value[k], str):
                raise RecordError(
                    where, f"{LAYOUT_RECORD}.{k}", f"{LAYOUT_RECORD}.{k} is {brief(value[k])}, not a string"
                )
        note = value.get("quantization_config")
        if note is not None and not (isinstance(note, dict) and isinstance(note.get("source"), dict)):
            raise RecordError(
                where,
                f"{LAYOUT_RECORD}.quantization_config",
                f"{LAYOUT_RECORD}.quantization_config is {brief(note)}, not a note holding the source's config",
            )
        return cls(value["layout"], value["table"], value["table_version"], value["tool_version"], note)
