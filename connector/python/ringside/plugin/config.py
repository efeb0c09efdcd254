"""The configuration of the engine plugins: one typed set of keys.

vLLM passes it as ``kv_connector_extra_config`` (``--kv-transfer-config``),
SGLang as ``--hicache-storage-backend-extra-config``. :meth:`Config.parse`
checks it when the engine starts: an unknown key is an error that names it
and the closest valid key, a bad value one that names the key, the value and
what is allowed. A typo never silently becomes a default.

Every key is a field of :class:`Config` with its type, default, unit, the
plugins that read it, its allowed range and a one-line meaning. The table of
keys in docs/configuration.md ("Plugin keys") and the deploy rules' list
(deploy/testdata/connector-keys.json) are generated from it and checked
against it by tests::

    python -m ringside.plugin.config --markdown     # the table of keys
    python -m ringside.plugin.config --update-doc docs/configuration.md
                                                    # rewrite it in the page
    python -m ringside.plugin.config --deploy-keys  # the deploy rules' keys
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

VLLM = "vllm"
SGLANG = "sglang"
_BOTH = (VLLM, SGLANG)
PLUGIN_NAMES = {VLLM: "the vLLM connector", SGLANG: "the SGLang backend"}
# Where each engine takes the keys from (for error messages).
SETTING = {VLLM: "kv_connector_extra_config", SGLANG: "hicache_storage_backend_extra_config"}
# Keys of the same dictionary that the engine itself reads (SGLang's dynamic
# backend loader and cache controller): accepted, never ours.
ENGINE_KEYS = {
    VLLM: frozenset(),
    SGLANG: frozenset(
        {
            "backend_name",
            "module_path",
            "class_name",
            "interface_v1",
            "tp_lcm_size",
            "prefetch_threshold",
            "prefetch_timeout_base",
            "prefetch_timeout_per_ki_token",
            "hicache_storage_pass_prefix_keys",
        }
    ),
}

DEFAULT_SOCKET = "/dev/shm/ringside/ringside.sock"  # also client.DEFAULT_SOCKET
SOCKET_ENV = "RINGSIDE_SOCKET"

# Value kinds.
STRING, NUMBER, INTEGER, BOOLEAN, AUTO_BOOLEAN = "string", "number", "integer", "boolean", "auto|boolean"
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class ConfigError(ValueError):
    """A key or value of the plugin configuration that is not valid."""


@dataclass(frozen=True)
class KeyInfo:
    """What :func:`_key` records about a field (``dataclasses.fields(Config)[i].metadata["key"]``)."""

    kind: str
    unit: str
    doc: str
    plugins: tuple
    minimum: Optional[float] = None
    exclusive: bool = False  # the minimum itself is not allowed
    maximum: Optional[float] = None
    optional: bool = False  # null allowed (the default)
    # A STRING key whose value is a comma-separated list of these words (or
    # "none", the empty list).
    choices: tuple = ()
    # A STRING key whose value is one of these words.
    one_of: tuple = ()

    def allowed(self) -> str:
        """What a value must be, in words."""
        if self.kind == STRING and self.one_of:
            return "one of " + ", ".join(self.one_of)
        if self.kind == STRING and self.choices:
            return '"none" or a comma-separated list of ' + ", ".join(self.choices)
        if self.kind == STRING:
            return "a string" + (" or null" if self.optional else "")
        if self.kind == BOOLEAN:
            return "true or false"
        if self.kind == AUTO_BOOLEAN:
            return '"auto", true or false'
        what = "an integer" if self.kind == INTEGER else "a number"
        if self.unit:
            what += " of " + self.unit
        if self.minimum is not None:
            what += " %s %s" % (">" if self.exclusive else ">=", _num(self.minimum))
        if self.maximum is not None:
            what += (" and" if self.minimum is not None else "") + " <= %s" % _num(self.maximum)
        return what


def _num(x: float) -> str:
    return "%d" % x if float(x).is_integer() else repr(float(x))


def _key(default: Any, kind: str, doc: str, *, unit: str = "", plugins: tuple = _BOTH, **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={"key": KeyInfo(kind, unit, doc, plugins, **kw)})


_U32_MS = 0xFFFFFFFF / 1000.0  # a lease TTL travels as u32 milliseconds


@dataclass(frozen=True)
class Config:
    """The plugin configuration (see the module doc). Build it with :meth:`parse`."""

    # -- both plugins ---------------------------------------------------------
    socket: str = _key(
        "",
        STRING,
        "The sidecar's Unix socket; empty: $RINGSIDE_SOCKET, else /dev/shm/ringside/ringside.sock.",
        unit="path",
    )
    timeout: float = _key(2.0, NUMBER, "Deadline of one sidecar call.", unit="seconds", minimum=0, exclusive=True)
    lease_ttl: float = _key(
        30.0,
        NUMBER,
        "Lifetime of a lease on blocks being loaded (the sidecar ends it after that).",
        unit="seconds",
        minimum=0,
        exclusive=True,
        maximum=_U32_MS,
    )
    save_timeout: float = _key(
        5.0,
        NUMBER,
        "Deadline of a step's stores (vLLM) or a batch's (SGLang).",
        unit="seconds",
        minimum=0,
        exclusive=True,
    )
    load_timeout: float = _key(
        5.0,
        NUMBER,
        "Deadline of a request's load (vLLM) or a batch's (SGLang).",
        unit="seconds",
        minimum=0,
        exclusive=True,
    )
    reattach_interval: float = _key(
        5.0,
        NUMBER,
        "Least time between two attach attempts after the sidecar was lost.",
        unit="seconds",
        minimum=0,
    )
    tenant: str = _key("", STRING, "Tenant salt: engines share blocks only within one tenant.")
    instance: str = _key(
        "",
        STRING,
        "Engine instance id shared by its processes; empty: vLLM's engine_id, SGLang's parent pid "
        "(set it for multi-node tensor parallelism).",
    )
    # -- vLLM ----------------------------------------------------------------
    max_wait_us: float = _key(
        100.0,
        NUMBER,
        "Most the scheduler waits for sidecar replies in one step, in total.",
        unit="microseconds",
        plugins=(VLLM,),
        minimum=0,
    )
    sync_saves: bool = _key(
        False,
        BOOLEAN,
        "Wait for a step's stores in wait_for_save instead of at the start of the next step.",
        plugins=(VLLM,),
    )
    overlap_saves: Union[str, bool] = _key(
        "auto",
        AUTO_BOOLEAN,
        "Let a step's stores run on through the next forward pass when no block they read "
        'can have been handed on; "auto": for GPU memory only.',
        plugins=(VLLM,),
    )
    store_decode_every: int = _key(
        1,
        INTEGER,
        "Steps between two stores of the blocks that decoding fills (1: in the step that fills them; "
        "0: never, prompt blocks only; docs/architecture.md).",
        unit="steps",
        plugins=(VLLM,),
        minimum=0,
    )
    pd_producer: bool = _key(
        False,
        BOOLEAN,
        "On a prefill engine: a request that asks for a remote decode (kv_transfer_params do_remote_decode) "
        "answers with the blocks it stored, which the decode engine waits for (docs/vllm.md).",
        plugins=(VLLM,),
    )
    pd_wait_s: float = _key(
        0.0,
        NUMBER,
        "On a decode engine: most a request waits for the blocks a prefill announced (ringside_pd_blocks) "
        "before it computes the rest (0: never waits, the key is ignored; docs/vllm.md).",
        unit="seconds",
        plugins=(VLLM,),
        minimum=0,
        maximum=600,
    )
    pd_max_waiting: int = _key(
        16,
        INTEGER,
        "On a decode engine: most requests that wait for a prefill's blocks at once; one more computes at once.",
        unit="requests",
        plugins=(VLLM,),
        minimum=0,
    )
    kv_cache_access: str = _key(
        "exports_fd",
        STRING,
        "How vLLM 0.34 and later allocates a CUDA KV cache for the sidecar: exports_fd (its extensible cache, "
        "shared by file descriptor) or legacy_ipc (the extensible cache off: beside NixlConnector, or with a "
        "cache sized by hand; docs/vllm.md).",
        plugins=(VLLM,),
        one_of=("exports_fd", "legacy_ipc"),
    )
    hint_sources: str = _key(
        "none",
        STRING,
        "Where retention hints are honoured from: kv_hints (vLLM's KvHintsEnvelope, set through the engine's "
        "API), kv_transfer_params (request bodies: only behind a gateway that strips them; docs/vllm.md).",
        plugins=(VLLM,),
        choices=("kv_hints", "kv_transfer_params"),
    )
    retain_max_blocks: int = _key(
        1024,
        INTEGER,
        "Most leading blocks of one request that its retention hint keeps.",
        unit="blocks",
        plugins=(VLLM,),
        minimum=1,
    )
    mirror: bool = _key(True, BOOLEAN, "Keep a local index of the cache (docs/architecture.md).", plugins=(VLLM,))
    mirror_max_blocks: int = _key(
        4_000_000,
        INTEGER,
        "Largest namespace the local index copies (~110 bytes a block); larger turns it off.",
        unit="blocks",
        plugins=(VLLM,),
        minimum=0,
    )
    mirror_idle_ms: float = _key(
        5.0,
        NUMBER,
        "An arrival after this long with no request in flight and no step first brings the index up to date.",
        unit="milliseconds",
        plugins=(VLLM,),
        minimum=0,
    )
    mirror_poll_ms: float = _key(
        50.0,
        NUMBER,
        "The change log is polled in a step that follows arrivals, else this often.",
        unit="milliseconds",
        plugins=(VLLM,),
        minimum=0,
    )
    mirror_max_lag_ms: float = _key(
        1000.0,
        NUMBER,
        "An index whose last answered poll is older than this is not used.",
        unit="milliseconds",
        plugins=(VLLM,),
        minimum=0,
        exclusive=True,
    )
    mirror_sync_us: float = _key(
        500.0,
        NUMBER,
        "Most a step waits while the index's snapshot is copied.",
        unit="microseconds",
        plugins=(VLLM,),
        minimum=0,
    )
    stats_path: Optional[str] = _key(
        None,
        STRING,
        "Write the connector's counters as JSON to `<stats_path>.<role>.<pid>.json` (at shutdown and every "
        "stats_every steps).",
        unit="path",
        plugins=(VLLM,),
        optional=True,
    )
    stats_every: int = _key(
        50, INTEGER, "Steps between two writes of stats_path.", unit="steps", plugins=(VLLM,), minimum=1
    )
    kv_events: Union[str, bool] = _key(
        "auto",
        AUTO_BOOLEAN,
        "Announce the sidecar's blocks in vLLM's own KV event stream (medium CPU, docs/architecture.md); "
        '"auto": when --kv-events-config enables KV cache events.',
        plugins=(VLLM,),
    )
    kv_events_poll_ms: float = _key(
        50.0,
        NUMBER,
        "The sidecar's event log is polled, and the stores since the last poll described, at the end of a "
        "step at most this often.",
        unit="milliseconds",
        plugins=(VLLM,),
        minimum=0,
    )
    # -- SGLang --------------------------------------------------------------
    model: str = _key("", STRING, "Model name of the namespace; empty: SGLang's model_name.", plugins=(SGLANG,))
    max_batches: int = _key(
        4096,
        INTEGER,
        "Key lists kept registered as hash batches (an LRU).",
        unit="batches",
        plugins=(SGLANG,),
        minimum=1,
    )
    staging_pages: int = _key(
        8,
        INTEGER,
        "Pages of the staging buffer of the tensor methods (get/set).",
        unit="pages",
        plugins=(SGLANG,),
        minimum=1,
    )

    # ------------------------------------------------------------------------

    @classmethod
    def parse(cls, extra: Optional[Mapping], plugin: str) -> "Config":
        """The configuration of ``plugin`` (VLLM or SGLANG) from the engine's
        extra config dictionary; raises ConfigError for an unknown key, a key
        of the other plugin, or a value of the wrong type or range."""
        if plugin not in PLUGIN_NAMES:
            raise ValueError("unknown plugin %r" % plugin)
        where = SETTING[plugin]
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError("ringside: %s is %s, want a JSON object" % (where, type(extra).__name__))
        infos = key_infos()
        values = {}
        for name, raw in extra.items():
            info = infos.get(name)
            if info is None:
                if name in ENGINE_KEYS[plugin]:
                    continue
                raise ConfigError("ringside: %s: unknown key %r%s" % (where, name, _closest(name, plugin)))
            if plugin not in info.plugins:
                raise ConfigError(
                    "ringside: %s: key %r is read by %s only, not by %s%s"
                    % (
                        where,
                        name,
                        " and ".join(PLUGIN_NAMES[p] for p in info.plugins),
                        PLUGIN_NAMES[plugin],
                        _closest(name, plugin),
                    )
                )
            values[name] = _convert(where, name, info, raw)
        return cls(**values)

    def socket_path(self) -> str:
        """The socket to attach to: the key, else $RINGSIDE_SOCKET, else the default."""
        return self.socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def key_infos() -> dict:
    """Key name -> KeyInfo, in declaration order."""
    return {f.name: f.metadata["key"] for f in dataclasses.fields(Config)}


def keys_of(plugin: str) -> list:
    """The keys one plugin reads, in declaration order."""
    return [k for k, info in key_infos().items() if plugin in info.plugins]


def _closest(name: str, plugin: str) -> str:
    if not isinstance(name, str):
        return ""
    near = difflib.get_close_matches(name, keys_of(plugin), n=1, cutoff=0.6)
    if near:
        return "; did you mean %r?" % near[0]
    return "; the keys are: " + ", ".join(keys_of(plugin))


def _convert(where: str, name: str, info: KeyInfo, raw: Any) -> Any:
    def bad() -> ConfigError:
        return ConfigError(
            "ringside: %s: %r is %s; want %s" % (where, name, json.dumps(raw, default=repr), info.allowed())
        )

    kind = info.kind
    if raw is None and info.optional:
        return None
    if kind == STRING:
        if not isinstance(raw, str):
            raise bad()
        if info.one_of:
            if raw.strip() not in info.one_of:
                raise bad()
            return raw.strip()
        if info.choices:
            words = [w.strip() for w in raw.split(",")]
            if words == ["none"]:
                return "none"
            if not all(w in info.choices for w in words) or len(set(words)) != len(words):
                raise bad()
            return ",".join(words)
        return raw
    if kind in (BOOLEAN, AUTO_BOOLEAN):
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str):
            s = raw.strip().lower()
            if kind == AUTO_BOOLEAN and s == "auto":
                return "auto"
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
        raise bad()
    # NUMBER, INTEGER: JSON numbers, or strings holding one.
    if isinstance(raw, bool):
        raise bad()
    try:
        x = float(raw.strip()) if isinstance(raw, str) else float(raw)
    except (TypeError, ValueError):
        raise bad() from None
    if not math.isfinite(x):
        raise bad()
    if kind == INTEGER:
        if not x.is_integer():
            raise bad()
        x = int(x)
    if info.minimum is not None and (x < info.minimum or (info.exclusive and x == info.minimum)):
        raise bad()
    if info.maximum is not None and x > info.maximum:
        raise bad()
    return x


# ----------------------------------------------------------------------------
# Generated documentation.


def _default_text(name: str, info: KeyInfo, default: Any) -> str:
    if default is None or default == "":
        return "—"
    if isinstance(default, bool):
        return "`%s`" % str(default).lower()
    if isinstance(default, str):
        return "`%s`" % default
    if isinstance(default, int):
        return "%s" % format(default, ",")
    return _num(default)


_KIND_TEXT = {
    STRING: "string",
    NUMBER: "number",
    INTEGER: "integer",
    BOOLEAN: "boolean",
    AUTO_BOOLEAN: '`"auto"` or boolean',
}


# The table of keys lies between these lines in docs/configuration.md.
DOC_BEGIN = "<!-- config-keys: begin (generated: python -m ringside.plugin.config --markdown) -->"
DOC_END = "<!-- config-keys: end -->"


def markdown_table() -> str:
    """The table of keys of docs/configuration.md (generated: see the module doc)."""
    names = {VLLM: "vLLM", SGLANG: "SGLang"}
    lines = ["| key | type | default | unit | read by | meaning |", "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        info = f.metadata["key"]
        lines.append(
            "| `%s` | %s | %s | %s | %s | %s |"
            % (
                f.name,
                _KIND_TEXT[info.kind],
                _default_text(f.name, info, f.default),
                info.unit or "—",
                ", ".join(names[p] for p in info.plugins),
                # The page is in docs/: the pages a meaning names are links.
                re.sub(r"\bdocs/([a-z0-9-]+\.md)\b", r"[docs/\1](\1)", info.doc),
            )
        )
    return "\n".join(lines) + "\n"


def deploy_keys() -> dict:
    """The vLLM keys as the deploy rules check them (deploy/testdata/connector-keys.json)."""
    out = {}
    for name, info in key_infos().items():
        if VLLM not in info.plugins:
            continue
        d: dict = {"type": info.kind}
        if info.minimum is not None:
            d["exclusiveMinimum" if info.exclusive else "minimum"] = info.minimum
        if info.maximum is not None:
            d["maximum"] = info.maximum
        if info.optional:
            d["nullable"] = True
        out[name] = d
    return out


def deploy_keys_json() -> str:
    return json.dumps(deploy_keys(), indent=2, sort_keys=True) + "\n"


def doc_with_table(text: str) -> str:
    """text (a page holding the DOC_BEGIN and DOC_END lines) with the table
    between them replaced by markdown_table()."""
    head, sep, rest = text.partition(DOC_BEGIN + "\n")
    if not sep:
        raise ValueError("no line %s" % DOC_BEGIN)
    _, sep, tail = rest.partition(DOC_END)
    if not sep:
        raise ValueError("no line %s after %s" % (DOC_END, DOC_BEGIN))
    return head + DOC_BEGIN + "\n" + markdown_table() + DOC_END + tail


def main(argv: list) -> int:
    if argv == ["--markdown"]:
        sys.stdout.write(markdown_table())
    elif argv == ["--deploy-keys"]:
        sys.stdout.write(deploy_keys_json())
    elif len(argv) == 2 and argv[0] == "--update-doc":
        with open(argv[1]) as f:
            text = f.read()
        new = doc_with_table(text)
        if new != text:
            with open(argv[1], "w") as f:
                f.write(new)
    else:
        sys.stderr.write("usage: python -m ringside.plugin.config --markdown | --update-doc PAGE | --deploy-keys\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
