"""Issue 48 item 3, the rough edges a user with their own model meets first, on the shipped
models: the fleet's address, said before it deploys."""

from __future__ import annotations

import logging
import re

import pytest

from eva0_edge.cli import build_parser
from tests.fixtures import MODEL, NAME


def test_the_fleet_says_its_url_and_binds_a_real_port_for_port_0(monkeypatch, caplog):
    """`serve --replicas 2 --port 0`: the fleet gets a free port by number (Ray Serve's proxy
    binds one) and the log names its URL (the fleet itself is not started here)."""
    pytest.importorskip("ray.serve")
    import eva0_edge.fleet.serve as fleet_serve

    started = {}
    monkeypatch.setattr(fleet_serve, "start_fleet",
                        lambda spec, replicas, config, host, port, *rest, **kw:
                        started.update(host=host, port=port))
    args = build_parser().parse_args(["serve", "--model", str(MODEL), "--replicas", "2",
                                      "--port", "0", "--threads", "1"])
    with caplog.at_level(logging.INFO, logger="eva0_edge"):
        args.func(args)
    assert started["host"] == "127.0.0.1" and started["port"] > 0
    url = f"http://127.0.0.1:{started['port']}/"
    assert re.search(f"will listen on {re.escape(url)} .*v2/models/{NAME}/infer", caplog.text)
