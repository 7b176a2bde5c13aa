"""Hosts on one machine: network namespaces, each with one interface on a
bridge of their own, for tests that run a CompactionRL job across hosts.

Everything lives in namespaces the harness creates and deletes: the bridge in
a namespace of its own, one namespace per host with ``eth0`` (a veth end)
holding an address of a private /24 picked at random, and ``lo``. Nothing is
added to the machine's own namespace but, for a moment, the veth pairs
being moved. ``ip netns exec`` runs a command on a host.

Usage::

    if (why := namespaces_unavailable()) is not None:
        pytest.skip(why)
    with Hosts(["replay", "learner", "actor"]) as hosts:
        hosts.address("replay")                  # 10.X.Y.2
        subprocess.run(hosts.run("actor", ["ip", "addr"]))
"""

from __future__ import annotations

import os
import random
import subprocess

INTERFACE = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def namespaces_unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"crl-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """Named hosts on one bridged /24 (see the module docstring)."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        tag = f"{os.getpid() % 100000}"
        self.prefix = f"crl{tag}"
        # a private /24 unlikely to be anyone's: 10.(200..249).(0..255).0
        self.subnet = f"10.{random.randint(200, 249)}.{random.randint(0, 255)}"
        self._veth = {name: f"c{tag}h{i}" for i, name in enumerate(self.names)}
        self.created: list[str] = []

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 2}"

    def run(self, name: str, command: list[str]) -> list[str]:
        """``command`` as run on host ``name``."""
        return ["ip", "netns", "exec", self.namespace(name), *command]

    def __enter__(self) -> Hosts:
        try:
            switch = self.namespace("switch")
            self._add(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for name in self.names:
                namespace, veth = self.namespace(name), self._veth[name]
                self._add(namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}b")
                _ip("link", "set", veth, "netns", namespace)
                _ip("link", "set", f"{veth}b", "netns", switch)
                _ip("-n", switch, "link", "set", f"{veth}b", "master", "br0", "up")
                _ip("-n", namespace, "link", "set", veth, "name", INTERFACE)
                _ip("-n", namespace, "addr", "add", f"{self.address(name)}/24", "dev", INTERFACE)
                _ip("-n", namespace, "link", "set", INTERFACE, "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self.created.append(namespace)

    def pids(self) -> list[int]:
        """Processes still running in any of the hosts."""
        found = []
        for namespace in self.created:
            listed = _ip("netns", "pids", namespace, check=False)
            found += [int(pid) for pid in listed.stdout.split()]
        return found

    def close(self) -> None:
        """Delete every namespace made (their veth ends go with them)."""
        for namespace in reversed(self.created):
            _ip("netns", "del", namespace, check=False)
        self.created.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


def our_namespaces(prefix: str) -> list[str]:
    """The namespaces on this machine whose name starts with ``prefix``."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(prefix)]
