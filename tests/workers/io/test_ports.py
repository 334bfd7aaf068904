"""workers/io/ports.py: a port for a later listener comes from below the kernel's ephemeral
range (where no outgoing connection is given one) and is free when chosen."""
import socket

from workers.io import ports


def test_a_chosen_port_is_below_the_ephemeral_range_and_a_listener_can_bind_it():
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port("127.0.0.1")
        assert max(1024, low - ports._SPAN) <= port < low
        with socket.create_server(("127.0.0.1", port)) as listener:
            assert listener.getsockname()[1] == port


def test_a_port_with_a_listener_is_never_chosen(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        # a range of one free port beside the busy one: every try of the busy one fails to bind
        monkeypatch.setattr(ports, "ephemeral_low", lambda: busy + 1)
        monkeypatch.setattr(ports, "_SPAN", 256)
        chosen = {ports.free_port("127.0.0.1") for _ in range(50)}
    assert busy not in chosen


def test_without_room_below_the_range_the_kernel_picks(tmp_path, monkeypatch):
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1100\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", str(wide))
    assert ports.ephemeral_low() == 1100
    port = ports.free_port("127.0.0.1")
    assert port >= 1100  # bind(0): the kernel's own range
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_the_choice_ignores_randoms_global_state():
    # a run seeds `random` (and a resumed run restores its state): ports drawn from it would
    # repeat in a run and its resumption, or in two processes seeded alike
    import random

    drawn = []
    for _ in range(5):
        random.seed(0)
        drawn.append(ports.free_port("127.0.0.1"))
    assert len(set(drawn)) > 1, drawn
