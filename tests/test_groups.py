"""ddpcomm.groups: which backend runs a collective, and the second-phase sequencer.

On NCCL the two-phase algorithm issues phase 2 on the group itself, inline in bucket
order, and creates no group inside a hook (a member-only group hangs torch's eager NCCL
split under ``init_process_group(device_id=...)``). Whether a backend's callbacks really
run inline is checked at every ticket; the NCCL cases themselves run in the GPU suite.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpcomm import groups


@pytest.mark.parametrize(
    "name, device, want",
    [
        ("gloo", "cpu", "gloo"),
        ("nccl", "cuda:0", "nccl"),
        ("cpu:gloo,cuda:nccl", "cuda:1", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
    ],
)
def test_backend_of_a_device(monkeypatch, name, device, want):
    monkeypatch.setattr(dist, "get_backend", lambda pg: name)
    assert groups.backend_of(object(), torch.device(device)) == want


def test_inline_sequencer_shares_the_group_and_issues_at_once():
    group = object()  # never used as a group: an inline sequencer creates none
    seq = groups.Sequencer(group, inline=True)
    assert seq.companion is group
    issued = []
    for bucket in range(3):
        ticket = seq.ticket()
        seq.submit(ticket, lambda b=bucket: issued.append(b))
        assert issued == list(range(bucket + 1))  # before the next bucket's phase 1


def test_inline_sequencer_refuses_a_deferred_second_phase():
    seq = groups.Sequencer(object(), inline=True)
    seq.ticket()  # its phase 2 never issued: callbacks did not run inline
    with pytest.raises(RuntimeError, match="not issued inline"):
        seq.ticket()


def test_deferred_sequencer_issues_in_ticket_order(monkeypatch):
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: [0, 1])
    monkeypatch.setattr(dist, "get_backend", lambda g: "gloo")
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: "companion")
    monkeypatch.setattr(groups, "align_group_names", lambda *a: None)  # needs a real group
    seq = groups.Sequencer(object(), inline=False)
    assert seq.companion == "companion"
    issued = []
    tickets = [seq.ticket() for _ in range(3)]
    for t in (2, 0, 1):  # callbacks land out of order
        seq.submit(tickets[t], lambda t=t: issued.append(t))
    assert issued == [0, 1, 2]
