"""ringside.plugin.config: parsing, errors, and the documents generated from it
(docs/configuration.md's table of keys, the deploy rules' list of keys)."""

import json
import os

import pytest

from ringside.plugin.config import (
    SGLANG,
    VLLM,
    Config,
    ConfigError,
    deploy_keys,
    deploy_keys_json,
    doc_with_table,
    key_infos,
    keys_of,
    main,
    markdown_table,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIGURATION = os.path.join(REPO, "docs", "configuration.md")
DEPLOY_KEYS = os.path.join(REPO, "deploy", "testdata", "connector-keys.json")
BEGIN, END = (
    "<!-- config-keys: begin (generated: python -m ringside.plugin.config --markdown) -->",
    "<!-- config-keys: end -->",
)


def test_defaults():
    c = Config.parse(None, VLLM)
    assert (c.timeout, c.lease_ttl, c.max_wait_us, c.mirror, c.overlap_saves, c.stats_path) == (
        2.0, 30.0, 100.0, True, "auto", None)  # fmt: skip
    assert Config.parse({}, SGLANG).max_batches == 4096
    assert len(keys_of(VLLM)) == 28 and len(keys_of(SGLANG)) == 11
    assert (c.kv_events, c.kv_events_poll_ms) == ("auto", 50.0)
    assert c.store_decode_every == 1
    assert (c.pd_producer, c.pd_wait_s, c.pd_max_waiting) == (False, 0.0, 16)
    assert (c.hint_sources, c.retain_max_blocks) == ("none", 1024)


def test_values_are_converted():
    c = Config.parse({"timeout": "1.5", "mirror": "off", "overlap_saves": "AUTO", "mirror_max_blocks": 4e6,
                      "sync_saves": 1, "stats_path": "/tmp/x", "socket": "/dev/shm/a.sock"}, VLLM)  # fmt: skip
    assert (c.timeout, c.mirror, c.overlap_saves, c.mirror_max_blocks, c.sync_saves) == (1.5, False, "auto",
                                                                                           4_000_000, True)  # fmt: skip
    assert isinstance(c.mirror_max_blocks, int) and c.socket_path() == "/dev/shm/a.sock"


def test_socket_default(monkeypatch):
    monkeypatch.delenv("RINGSIDE_SOCKET", raising=False)
    assert Config.parse({}, VLLM).socket_path() == "/dev/shm/ringside/ringside.sock"
    monkeypatch.setenv("RINGSIDE_SOCKET", "/dev/shm/env.sock")
    assert Config.parse({"socket": ""}, VLLM).socket_path() == "/dev/shm/env.sock"


@pytest.mark.parametrize(
    "plugin, extra, words",
    [
        (VLLM, {"max_wait_usec": 1}, ["kv_connector_extra_config", "'max_wait_usec'", "did you mean 'max_wait_us'?"]),
        (VLLM, {"zzz": 1}, ["unknown key 'zzz'", "the keys are: socket, timeout"]),
        (VLLM, {"lease_ttl": -1}, ["'lease_ttl' is -1", "a number of seconds > 0"]),
        (VLLM, {"lease_ttl": 5e6}, ["'lease_ttl'", "<= 4294967.295"]),
        (VLLM, {"timeout": float("nan")}, ["'timeout' is NaN"]),
        (VLLM, {"timeout": True}, ["'timeout' is true"]),
        (VLLM, {"tenant": 7}, ["'tenant' is 7", "want a string"]),
        (VLLM, {"sync_saves": "perhaps"}, ["'sync_saves'", "true or false"]),
        (VLLM, {"mirror_max_blocks": 1.5}, ["'mirror_max_blocks' is 1.5", "an integer of blocks >= 0"]),
        (VLLM, {"staging_pages": 4}, ["'staging_pages' is read by the SGLang backend only"]),
        (SGLANG, {"max_batch": 4}, ["hicache_storage_backend_extra_config", "did you mean 'max_batches'?"]),
        (SGLANG, {"stats_path": "/x"}, ["'stats_path' is read by the vLLM connector only"]),
        (SGLANG, {"staging_pages": 0}, ["'staging_pages' is 0", ">= 1"]),
    ],
)
def test_errors_name_key_value_and_allowed(plugin, extra, words):
    with pytest.raises(ConfigError) as e:
        Config.parse(extra, plugin)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_engine_keys_pass():
    Config.parse({"backend_name": "ringside", "module_path": "ringside.sglang", "class_name": "X", "interface_v1": 1},
                 SGLANG)  # fmt: skip
    with pytest.raises(ConfigError):
        Config.parse({"backend_name": "ringside"}, VLLM)


def test_every_key_documented():
    for name, info in key_infos().items():
        assert info.doc and info.doc.endswith("."), name
        assert info.plugins, name


def test_doc_table_is_the_configuration():
    text = open(CONFIGURATION).read()
    assert BEGIN in text and END in text, "docs/configuration.md lacks the generated table of keys"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert table == markdown_table(), (
        "docs/configuration.md's table of plugin keys differs from ringside.plugin.config: regenerate it with "
        "`make docs` (or `PYTHONPATH=connector/python python3 -m ringside.plugin.config --update-doc "
        "docs/configuration.md`)"
    )


def test_update_doc_replaces_only_the_table(tmp_path):
    stale = "# page\n\nbefore\n\n" + BEGIN + "\n| key |\n|---|\n| `old` |\n" + END + "\n\nafter\n"
    page = tmp_path / "page.md"
    page.write_text(stale)
    assert main(["--update-doc", str(page)]) == 0
    assert page.read_text() == "# page\n\nbefore\n\n" + BEGIN + "\n" + markdown_table() + END + "\n\nafter\n"
    assert doc_with_table(page.read_text()) == page.read_text()
    with pytest.raises(ValueError):
        doc_with_table("# no markers\n")


def test_deploy_rule_keys_are_the_configuration():
    got = open(DEPLOY_KEYS).read()
    assert got == deploy_keys_json(), (
        "deploy/testdata/connector-keys.json differs from ringside.plugin.config: regenerate it with "
        "`python -m ringside.plugin.config --deploy-keys > deploy/testdata/connector-keys.json`"
    )
    assert set(json.loads(got)) == set(keys_of(VLLM)) == set(deploy_keys())


def test_kv_cache_access_is_one_of_two():
    assert Config.parse({}, VLLM).kv_cache_access == "exports_fd"
    assert Config.parse({"kv_cache_access": " legacy_ipc"}, VLLM).kv_cache_access == "legacy_ipc"
    for bad in ("fd", "", "exports_fd,legacy_ipc", 1, None):
        with pytest.raises(ConfigError, match="kv_cache_access.*one of exports_fd, legacy_ipc"):
            Config.parse({"kv_cache_access": bad}, VLLM)
