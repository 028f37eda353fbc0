"""routing = "affinity" in deploy/haproxy/generate.py (issue 31): the key is read
in the documented order with a bounded prefix, both backends of a model hash
it on one ring (same server ids and weights), only the overflow backend has a
balance factor, and routing = "first" still writes today's file. HAProxy
itself accepts both (`haproxy -c`); tests/reliability/test_haproxy_affinity.py
drives them."""

from __future__ import annotations

import re

import pytest

from tests.unit.test_deploy_haproxy import CFG, FLEET, generate, haproxy_check, needs_haproxy, servers

BASE = {"replicas": ["r1", "r2", "r3"], "models": {"chat": {}, "coder": {"replicas": ["r3", "r1"]}}}


def render(**extra) -> str:
    return generate.render(generate.parse_fleet({**BASE, **extra}))


def backend(text: str, name: str) -> str:
    return text.split(f"\nbackend {name}\n", 1)[1].split("\n\n", 1)[0]


def test_the_committed_fleet_routes_by_affinity():
    fleet = generate.load_fleet(FLEET)
    assert fleet.routing == "affinity" and fleet.balance_factor == generate.BALANCE_FACTOR
    assert "balance hash var(txn.key)" in CFG.read_text()


def test_the_key_is_read_in_the_documented_order_and_bounded():
    text = render()
    keys = re.findall(r"http-request set-var\(txn\.key\) (\S+)", text)
    assert keys == [
        f"req.body,json_query('$.prompt_cache_key'),bytes(0,{generate.KEY_BYTES})",
        f"req.body,json_query('$.user'),bytes(0,{generate.KEY_BYTES})",
        f"req.body,json_query('$.metadata.user_id'),bytes(0,{generate.KEY_BYTES})",
        f"req.hdr(x-session-id),bytes(0,{generate.KEY_BYTES})",
        *[f"req.body,json_query('{path}'),bytes(0,{generate.BLOCK_BYTES})" for path in
          ("$.system", "$.system[0].text", "$.messages[0].content", "$.messages[0].content[0].text",
           "$.prompt", "$.input")],
        "var(txn.model)"]
    # Each later source only where no earlier one gave a non-empty key.
    lines = [line for line in text.splitlines() if "set-var(txn.key)" in line]
    assert not lines[0].endswith(generate.NO_KEY)
    assert all(line.endswith(f"if {generate.NO_KEY}") for line in lines[1:])
    # After the model is known (the last fallback is its name), before the backend is chosen.
    assert text.index("set-var(txn.model) str(chat)") < text.index("set-var(txn.key) var(txn.model)") \
        < text.index("use_backend")


def test_both_backends_of_a_model_hash_on_one_ring():
    text = render()
    lines = servers(text)
    for model, order in (("chat", ["r1", "r2", "r3"]), ("coder", ["r3", "r1"])):
        serve = {name: rest for name, rest in lines[f"model.{model}"] if "backup" not in rest}
        overflow = dict(lines[f"overflow.{model}"])
        assert list(serve) == list(overflow) == order
        for name in order:
            ident = re.search(r" id (\d+) ", serve[name]).group(1)
            # Same id and weight: the same points on the ring, so a key has one replica in both.
            assert ident == re.search(r" id (\d+) ", overflow[name]).group(1) == str(BASE["replicas"].index(name) + 1)
            assert f" weight {generate.SERVER_WEIGHT} " in serve[name] and f" weight {generate.SERVER_WEIGHT} " in overflow[name]
        ids = [re.search(r" id (\d+) ", rest).group(1) for _, rest in lines[f"model.{model}"]]
        assert len(set(ids)) == len(ids)  # HAProxy refuses two servers of one backend with one id
        assert "hash-balance-factor" not in backend(text, f"model.{model}")  # the slot bound only
        assert f"hash-balance-factor {generate.BALANCE_FACTOR}" in backend(text, f"overflow.{model}")
        for name in (f"model.{model}", f"overflow.{model}"):
            assert "balance hash var(txn.key)\n    hash-type consistent sdbm avalanche" in backend(text, name)


def test_routing_first_writes_todays_file():
    text = render(routing="first")
    assert "txn.key" not in text and "hash" not in text
    assert not any(" weight " in rest for lines in servers(text).values() for _, rest in lines)
    assert backend(text, "model.chat").startswith("    balance first")
    assert backend(text, "overflow.chat").splitlines()[1] == "    balance leastconn"


def test_the_balance_factor_is_the_descriptions():
    assert "hash-balance-factor 175" in render(balance_factor=175)


@pytest.mark.parametrize("extra, needle", [
    ({"routing": "random"}, "routing 'random' must be one of ['affinity', 'first']"),
    ({"routing": 1}, "routing 1 must be one of"),
    ({"balance_factor": 100}, "balance_factor 100 must be a whole percentage from 101 to 1000"),
    ({"balance_factor": -5}, "balance_factor -5"),
    ({"balance_factor": 10**9}, "balance_factor 1000000000"),
    ({"balance_factor": 150.5}, "balance_factor 150.5"),
    ({"balance_factor": "150"}, "balance_factor '150'"),
    ({"balance_factor": True}, "balance_factor True"),
])
def test_a_bad_routing_is_refused_with_the_key(extra, needle):
    with pytest.raises(generate.FleetError, match=re.escape(needle)):
        generate.parse_fleet({**BASE, **extra})


@needs_haproxy
@pytest.mark.parametrize("extra", [{}, {"routing": "first"}, {"balance_factor": 1000}])
def test_haproxy_accepts_both_routings(tmp_path, extra):
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(render(**extra))
    done = haproxy_check(cfg, BASE["replicas"])
    assert done.returncode == 0 and "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
