"""DNS rebinding, with the defaults (issue 27, item 4): the Host check is on
without `allowed_hosts`. A page on attacker.example made to resolve to
127.0.0.1 sends `Host: attacker.example` and is refused (403) on every route,
admin routes included; what the daemon may legitimately be called by is
served: localhost names, loopback addresses, the address it is bound to (bound
to 0.0.0.0 or ::, any IP address and this machine's host name), and
`allowed_hosts`; `allowed_hosts = ["*"]` serves any host."""

from __future__ import annotations

import socket

import pytest

from config import Settings
from daemon.http.keys import Listening
from statemachine import ServerState
from tests.integration.test_http_hardening import COMPLETION, daemon, error_of, raw_http

REBOUND = ("attacker.example", "attacker.example:8080", "localhost.attacker.example", "127.0.0.1.nip.io",
           "x", "LOCALHOST.attacker.example.")


@pytest.mark.parametrize("host", REBOUND)
async def test_a_rebound_name_is_refused_on_every_route_by_default(host):
    async with daemon() as (controller, client):
        headers = {"Host": host}
        for method, path in (("GET", "/health"), ("GET", "/props"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("POST", "/sleep"), ("POST", "/wake"), ("GET", "/")):
            response = await client.request(method, path, headers=headers)
            assert (await error_of(response, 403))["code"] == "host_not_allowed", (method, path)
        response = await client.post("/v1/completions", json=COMPLETION, headers=headers)
        assert "allowed_hosts" in (await error_of(response, 403))["message"]
        assert controller.state is ServerState.READY  # /sleep did not run


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "LocalHost.", "app.localhost:3000", "127.0.0.1",
                                  "127.0.0.1:9", "127.5.6.7", "[::1]:8080", "[::ffff:127.0.0.1]"])
async def test_localhost_names_and_loopback_addresses_are_served(host):
    async with daemon() as (controller, client):
        assert (await client.get("/health", headers={"Host": host})).status == 200
        response = await client.post("/v1/completions", json=COMPLETION, headers={"Host": host})
        assert response.status == 200, await response.text()


async def test_bound_to_loopback_other_addresses_are_refused_and_no_host_is_refused():
    async with daemon() as (controller, client):
        for host in ("10.0.0.7", "[2001:db8::1]:8080", "0.0.0.0"):
            assert (await client.get("/health", headers={"Host": host})).status == 403, host
        status, _ = await raw_http(client, b"GET /health HTTP/1.0\n")  # no Host at all: no browser sends that
        assert status == 403


async def test_bound_to_a_wildcard_address_any_ip_and_this_machines_name_are_served():
    own = socket.gethostname().lower()
    async with daemon(host="0.0.0.0", admin_key="adm") as (controller, client):
        for host in ("10.0.0.7", "10.0.0.7:8080", "[2001:db8::1]:8080", "192.168.1.20", own, f"{own}:8080"):
            assert (await client.get("/health", headers={"Host": host})).status == 200, host
        for host in ("attacker.example", "dormouse.svc.cluster.local"):
            assert (await client.get("/health", headers={"Host": host})).status == 403, host
    async with daemon(host="0.0.0.0", admin_key="adm", allowed_hosts=["dormouse.svc.cluster.local"]) as (_, client):
        assert (await client.get("/health", headers={"Host": "dormouse.svc.cluster.local:8080"})).status == 200
        assert (await client.get("/health", headers={"Host": "attacker.example"})).status == 403


async def test_allowed_hosts_adds_names_and_star_serves_any_host():
    async with daemon(allowed_hosts=["models.example"]) as (controller, client):
        assert (await client.get("/health", headers={"Host": "models.example"})).status == 200
        assert (await client.get("/health", headers={"Host": "localhost"})).status == 200  # still served
        assert (await client.get("/health", headers={"Host": "attacker.example"})).status == 403
    async with daemon(allowed_hosts=["*"]) as (controller, client):
        for host in REBOUND:
            assert (await client.get("/health", headers={"Host": host})).status == 200, host


def test_star_is_the_only_wildcard_in_allowed_hosts():
    assert Settings(allowed_hosts="*").allowed_hosts == ["*"]
    assert Settings(allowed_hosts=["*", "Models.Example."]).allowed_hosts == ["*", "models.example"]
    with pytest.raises(ValueError, match="wildcard"):
        Settings(allowed_hosts=["*.example"])


def test_the_served_sockets_replace_what_the_settings_said():
    """A socket systemd passes is bound wherever its unit says: the Host check follows it."""
    listening = Listening()
    listening.bind("127.0.0.1")
    assert not listening.wildcard and listening.addresses == {"127.0.0.1"}
    listening.serve(["0.0.0.0"], fqdn="gpu1.corp.example")
    assert listening.wildcard and "gpu1.corp.example" in listening.names and not listening.addresses
    listening.serve(["10.0.0.7", "fe80::1%eth0"])
    assert not listening.wildcard and listening.addresses == {"10.0.0.7", "fe80::1"}
    assert "gpu1.corp.example" not in listening.names
    named = Listening()
    named.bind("dormouse.lan")  # host = a name: that name is what it is called by
    assert named.names == {"dormouse.lan"}
    named.serve(["192.0.2.10"])  # the name's address, as the bound socket shows it: the name stays served
    assert named.names == {"dormouse.lan"} and named.addresses == {"192.0.2.10"}
