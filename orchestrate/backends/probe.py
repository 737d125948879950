"""Gathering an inventory's nodes the way its file says they are reached: ``inventory check``.

A node whose entry (or the file's defaults) has a ``slurm:`` block goes through srun
(:mod:`orchestrate.backends.slurm.probe`): its jobs go through Slurm, and compute nodes often
refuse SSH from outside a job (pam_slurm_adopt). A node on this machine (loopback, or this
machine's host name) is gathered in this process (:func:`orchestrate.probe.machine.gather_local`).
Every other node is reached over SSH with its ``ssh`` settings and ``python``
(:mod:`orchestrate.backends.ssh.probe`). The answer, node name -> facts or
:class:`~orchestrate.probe.gathering.Unreachable`, is what :func:`orchestrate.probe.write.check`
compares with the file.

The SSH and Slurm transports are imported only when the file has such nodes (Fabric and Slurm
are optional).
"""

from __future__ import annotations

import socket
from collections.abc import Collection

from orchestrate.core.spec import hostlist
from orchestrate.core.spec.inventory import Inventory, InventorySpec
from orchestrate.probe.gathering import DEFAULT_BOUND_S, Gathered
from orchestrate.probe.machine import gather_local


def is_this_machine(address: str) -> bool:
    """Whether ``address`` names this machine: loopback, or its own host name."""
    if address in ("localhost", "::1") or address.startswith("127."):
        return True
    return address in (socket.gethostname(), socket.getfqdn())


def slurm_nodes_of(spec: InventorySpec) -> set[str]:
    """The nodes the file says Slurm runs: those whose entry, or the defaults, have a
    ``slurm:`` block (even an empty one). Their jobs go through Slurm, so their probe does too:
    compute nodes often refuse SSH from outside a job (pam_slurm_adopt), and srun reaches
    them wherever the controller is configured."""
    names: set[str] = set()
    for entry in spec.nodes:
        if entry.slurm is not None or spec.defaults.slurm is not None:
            names.update(hostlist.expand(entry.name))
    return names


def gather_for_check(inv: Inventory, slurm: Collection[str] = (), *, torch: bool = True,
                     import_torch: bool = False, bound_s: float = DEFAULT_BOUND_S,
                     fanout: int = 32) -> dict[str, Gathered]:
    """Raw facts for every node of ``inv``, each reached as the file says: the ``slurm`` nodes
    through srun (in their partition, with their python), nodes on this machine in this
    process (gathered once), the others over SSH with their ssh settings and python."""
    on_slurm = [n for n in inv.nodes if n.name in slurm]
    here = [n for n in inv.nodes if n.name not in slurm and is_this_machine(n.address)]
    remote = [n for n in inv.nodes if n.name not in slurm and not is_this_machine(n.address)]
    gathered: dict[str, Gathered] = {}
    if here:
        facts = gather_local(torch=torch, import_torch=import_torch)
        gathered.update({node.name: facts for node in here})
    if remote:
        from orchestrate.backends.ssh.probe import gather_over_ssh, node_targets

        gathered.update(gather_over_ssh(node_targets(remote), bound_s=bound_s, fanout=fanout,
                                        torch=torch, import_torch=import_torch))
    if on_slurm:
        from orchestrate.backends.slurm.probe import gather_inventory_nodes

        gathered.update(gather_inventory_nodes(on_slurm, bound_s=bound_s, torch=torch,
                                               import_torch=import_torch))
    return {node.name: gathered[node.name] for node in inv.nodes}


__all__ = ["gather_for_check", "is_this_machine", "slurm_nodes_of"]
