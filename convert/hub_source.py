"""Hub sources: a model-hub repository `org/name[@revision]`, read in place, opened as a
Source (convert/source.py) as convert/local.py opens a directory.

The revision is resolved to its commit first (one metadata request) and every later request
is pinned to that commit (convert/hub.py). config.json and the index are read from the
backend's cache when it holds them at that commit, else fetched. Of each shard one
speculative ranged read of its first SPECULATIVE_HEADER_BYTES is made, which holds the whole
header of almost every shard (a second read fetches the rest of a longer one); then only the
byte ranges the plan names. Offline (the backend says when: HF_HUB_OFFLINE for the Hugging
Face Hub), a repository whose files are all in the cache at the pinned revision is read from
the cache. Which hub: a backend (convert/hub_protocol.py), the Hugging Face Hub's unless the
caller gives another.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from dsv4.convert import progress
from dsv4.convert.errors import HubError
from dsv4.convert.hub import SPECULATIVE_HEADER_BYTES, CachedHubReader, HubReader, default_backend, download, repo_info
from dsv4.convert.hub_protocol import HubBackend
from dsv4.convert.inventory import Inventory
from dsv4.convert.source import HubSpec, Source
from dsv4.model.checkpoint import CONFIG, INDEX_NAME, SINGLE_FILE, load_index, merge_shards
from dsv4.model.config import parse_config
from dsv4.model.errors import CheckpointError
from dsv4.model.safetensors_header import TensorBytes, read_header


def open_hub(hub: HubSpec, *, quiet: bool = True, backend: HubBackend | None = None) -> Source:
    """Hub repository `hub` as a Source: a reader pinned to the commit its revision names now
    (from the backend's cache when offline), and its inventory from config.json, the index
    and each shard's header, with the same checks as a local directory's. Unless `quiet`, a
    bar counts the shard headers read (progress.py's rule: a terminal only)."""
    reader, names = _connect(hub, backend or default_backend())
    return Source(hub, reader, partial(_read_inventory, reader, hub, names, quiet))


def _connect(hub: HubSpec, backend: HubBackend) -> tuple[HubReader | CachedHubReader, set[str]]:
    """A reader of the commit `hub.revision` names, and the names of the files it has."""
    offline = backend.offline()
    if offline is not None:
        if hub.verify_files:
            raise HubError(
                f"{hub.location}: --verify-source checks files against the digests the hub publishes, and {offline}",
                kind="hub_request_failed",
                path=hub.location,
            )
        snapshot, commit = backend.cached_snapshot(hub)
        cached = CachedHubReader(snapshot, hub, commit)
        return cached, set(cached.sizes)
    try:
        commit, info = repo_info(backend, hub, files_metadata=True)
    except HubError as exc:
        if hub.explicit:
            raise
        # a bare org/name may also have been meant as a local path: say both readings
        raise type(exc)(f"{hub.repo}: no such local directory, and as a hub repository: {exc}", kind=exc.kind) from None
    sizes = {f.name: f.size for f in info.files if f.size is not None}
    published = {f.name: f.published for f in info.files if f.published is not None} if hub.verify_files else None
    return HubReader(hub, backend, commit, sizes, published), {f.name for f in info.files}


def _small_file(reader: HubReader | CachedHubReader, hub: HubSpec, file: str) -> bytes:
    """A file the hub listed (so it is there), checked with --verify-source."""
    if isinstance(reader, CachedHubReader):
        return (reader.root / file).read_bytes()
    data = download(hub, reader.commit, file, backend=reader.backend, session=reader.session)
    assert data is not None  # missing_ok is off: a missing file raised
    published = reader.published
    if published is not None:
        where = reader.where(file)
        if file not in published:
            raise HubError(
                f"{where}: the hub publishes no sha256 or git id for this file, so --verify-source cannot check it",
                kind="download_failed",
                path=where,
            )
        digest = published[file].hasher(len(data))
        digest.update(data)
        if digest.hexdigest() != published[file].digest:
            raise HubError(
                f"{where}: the {len(data):,} bytes downloaded do not match the {published[file].kind} the hub "
                "publishes: refused",
                kind="download_failed",
                path=where,
            )
    return data


def _first_read(reader: HubReader | CachedHubReader, file: str) -> bytes:
    """The speculative read of a shard: its first SPECULATIVE_HEADER_BYTES, which hold the
    whole header of almost every shard."""
    return reader.fetch(file, 0, min(SPECULATIVE_HEADER_BYTES, reader.sizes.get(file, SPECULATIVE_HEADER_BYTES)))


def _shard_header(reader: HubReader | CachedHubReader, file: str, first: bytes) -> tuple[dict[str, TensorBytes], int]:
    """The tensors of one hub shard and its header's size, from its first read (and a
    second for the rest of a longer header), checked as the local reader checks them."""
    size = reader.sizes.get(file)  # known now from the hub's listing or this answer's Content-Range, unless neither
    if size is None:
        raise HubError(
            f"{reader.location}/{file}@{reader.commit[:12]}: the hub gives no size for this file (neither its listing "
            "nor Content-Range)",
            kind="download_failed",
            path=file,
        )

    raw: list[bytes] = []

    def rest(n: int) -> bytes:
        have = first[8 : 8 + n]
        raw.append(have if len(have) == n else have + reader.fetch(file, len(first), 8 + n - len(first)))
        return raw[0]

    tensors, data_start = read_header(first[:8], rest, file, size)
    if reader.published is not None:  # --verify-source: what the verified file's header is compared with
        reader.header_sha256[file] = hashlib.sha256(first[:8] + raw[0]).hexdigest()
    return tensors, data_start


def _read_inventory(reader: HubReader | CachedHubReader, hub: HubSpec, names: set[str], quiet: bool) -> Inventory:
    """The inventory of the commit `reader` reads, whose files are `names`.

    Latency-bound (Flash: 46 shards), so every request is made at once, in one round trip
    after model info: config.json, the index, and the header of every shard the listing
    names (the index is not waited for: it names the same shards, and a listed shard it does
    not name costs one unused read). The answers are then checked in the order a reader going
    through them one by one would: config.json, the index, then the shards in index order;
    the first that fails is the error reported, and the reads not yet started are cancelled."""
    commit = reader.commit
    config_where = f"{hub.location}/{CONFIG}@{commit[:12]}"
    if CONFIG not in names:
        raise CheckpointError(
            f"{config_where}: no config.json in the repository", kind="missing_config", path=str(config_where)
        )
    pool = ThreadPoolExecutor(max_workers=reader.header_reads, thread_name_prefix="hub-header")
    try:
        small = {f: pool.submit(_small_file, reader, hub, f) for f in (CONFIG, INDEX_NAME) if f in names}
        listed = sorted(f for f in names if f.endswith(".safetensors") and "/" not in f)
        # the reads only: the headers are parsed here, in shard order, as their bytes come (a
        # thread per parse would hold back the requests not yet sent, and each other)
        firsts = {f: pool.submit(_first_read, reader, f) for f in listed}
        raw_config = small[CONFIG].result()
        config = parse_config(raw_config, config_where)
        weight_map, files = _shards(small, names, hub, commit)
        found = []
        with progress.bar(len(files), "shard headers", "shard", quiet) as shown:
            for file in files:
                if file not in firsts:  # named by the index but not listed at the top level
                    firsts[file] = pool.submit(_first_read, reader, file)
                found.append(_shard_header(reader, file, firsts[file].result()))
                shown.update(1)
    finally:
        pool.shutdown(cancel_futures=True)
    tensors = merge_shards(hub.location, weight_map, [(f, t) for f, (t, _) in zip(files, found, strict=True)])
    return Inventory(
        hub.location,
        config,
        tensors,
        {f: reader.sizes[f] for f in files},
        sum(data_start for _, data_start in found),
        revision=commit,
        config_bytes=raw_config,
    )


def _shards(
    small: dict[str, Future[bytes]], names: set[str], hub: HubSpec, commit: str
) -> tuple[dict[str, str] | None, list[str]]:
    """(the index's weight map, or None for one model.safetensors; the shards, sorted), each
    shard checked to be in the repository."""
    weight_map: dict[str, str] | None
    if INDEX_NAME in names:
        weight_map = load_index(small[INDEX_NAME].result(), INDEX_NAME)
        files = sorted(set(weight_map.values()))
    elif SINGLE_FILE in names:
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(
            f"{hub.location}@{commit[:12]}: neither {INDEX_NAME} nor {SINGLE_FILE} found", kind="missing_shard"
        )
    for file in files:
        if file not in names:
            raise CheckpointError(
                f"{hub.location}/{file}@{commit[:12]}: shard named in {INDEX_NAME} is not in the repository",
                kind="missing_shard",
            )
    return weight_map, files
