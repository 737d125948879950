"""A DDP checkpoint written in shares, in one process: every rank's share put together is the
file ``torch.save`` would write (it loads with ``torch.load``, equal tensor for tensor), the
shares are balanced, and buffers stay rank 0's so the file holds rank 0's state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from orchestrate.train import checkpoint, partwrite
from orchestrate.train.failure import TrainFailure

pytestmark = pytest.mark.unit


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.BatchNorm1d(300),
                                torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _side() -> dict[str, object]:
    return {"format": checkpoint.FORMAT, "step": 3, "ranks": [{"rng": torch.get_rng_state()}]}


def _two_ranks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
               step: int, copies: list[partwrite.PartCopy]) -> Path | None:
    """Rank 0's frame, rank 1's share, then rank 0's share and the rename (no group: the
    agreement is that both writes returned)."""
    shares = [copies[rank].take(model, optimizer, _side() if rank == 0 else {}, rank=rank,
                                ranks=2) for rank in (0, 1)]
    job = partwrite.start(shares[0], directory=directory, step=step, keep=1, rank=0, group=None)
    assert job.temporary is not None and job.table is not None
    partwrite.write_share(job.temporary, job.table, shares[1].mine)
    return job.run(lambda: None)


def test_two_shares_make_the_file_torch_save_writes_and_latest_names_it(tmp_path: Path) -> None:
    model, optimizer = _trained()
    copies = [partwrite.PartCopy(), partwrite.PartCopy()]
    path = _two_ranks(model, optimizer, tmp_path, 3, copies)
    assert path == tmp_path / "step-00000003.pt"
    assert checkpoint.find_latest(tmp_path) == path and checkpoint.incomplete(path) is None
    loaded = checkpoint.load(path)
    expected = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    for (key, want), (got_key, got) in zip(partwrite.leaves(expected),
                                           partwrite.leaves({k: loaded[k] for k in expected}),
                                           strict=True):
        assert key == got_key and torch.equal(want, got), key
    assert torch.equal(loaded["ranks"][0]["rng"], torch.get_rng_state())
    assert loaded["step"] == 3 and loaded["optimizer"]["param_groups"][0]["lr"] == 1e-3
    # The next save overwrites the kept copies, keeps one checkpoint, and is whole again.
    optimizer.step()
    second = _two_ranks(model, optimizer, tmp_path, 4, copies)
    assert second is not None and checkpoint.checkpoints_in(tmp_path) == [(4, second)]
    assert torch.equal(checkpoint.load(second)["model"]["0.weight"], model[0].weight)
    # The pruned step 3 is kept hidden as the spare, and the next checkpoint is written into
    # that very file (its pages reused): whole, though the spare held other bytes.
    spare = partwrite.spare_in(tmp_path)
    assert [p.name for p in tmp_path.glob(".*tmp*")] == [spare.name]
    inode = spare.stat().st_ino
    optimizer.step()
    third = _two_ranks(model, optimizer, tmp_path, 5, copies)
    assert third is not None and third.stat().st_ino == inode
    loaded = checkpoint.load(third)
    assert checkpoint.incomplete(third) is None
    for key, want in {"model": model.state_dict(), "optimizer": optimizer.state_dict()}.items():
        for (name, value), (_, got) in zip(partwrite.leaves(want), partwrite.leaves(loaded[key]),
                                           strict=True):
            assert torch.equal(value, got), (key, name)
    assert checkpoint.checkpoints_in(tmp_path) == [(5, third)]
    assert checkpoint.clean_temporaries(tmp_path) == [spare]  # a later start deletes it


def test_shares_are_balanced_and_buffers_and_small_tensors_are_rank_0s() -> None:
    model, optimizer = _trained()
    _, found, owner = partwrite.PartCopy.plan(model, optimizer, 2)
    by_key = {key: who for (key, _), who in zip(found, owner, strict=True)}
    assert by_key[("model", "1.running_mean")] == 0
    assert by_key[("optimizer", "state", 0, "step")] == 0
    sizes = [partwrite.PartCopy.needs(model, optimizer, rank=r, ranks=2) for r in (0, 1)]
    total = sum(t.numel() * t.element_size() for _, t in found)
    assert sum(sizes) == total and abs(sizes[0] - sizes[1]) < 0.3 * total
    assert partwrite.owners([5, 100_000, 90_000, 80_000], [True] * 4, 2) == [0, 1, 0, 0]
    assert partwrite.owners([100_000, 90_000], [False, True], 3) == [0, 1]


def test_a_share_that_does_not_fit_rank_0s_frame_fails_and_nothing_is_kept(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    share = partwrite.PartCopy().take(model, optimizer, _side(), rank=0, ranks=1)
    job = partwrite.start(share, directory=tmp_path, step=5, keep=1, rank=0, group=None)
    assert job.temporary is not None and job.table is not None
    wrong = {("model", "0.weight"): torch.zeros(3)}
    with pytest.raises(TrainFailure, match="not in rank 0's frame"):
        partwrite.write_share(job.temporary, job.table, wrong)
    job.temporary.unlink()
    failed = partwrite.Job(tmp_path, 5, 1, 0, None, share, job.temporary, None, "disk full")
    with pytest.raises(TrainFailure, match=r"step-00000005.pt was not written: rank 0: rank 0 "
                       r"wrote no frame \(disk full\)"):
        failed.run(lambda: None)
    assert checkpoint.find_latest(tmp_path) is None


def test_only_ranks_that_see_rank_0s_checkpoint_folder_write_shares(tmp_path: Path) -> None:
    here = partwrite.place_of(tmp_path)
    assert here is not None and partwrite.place_of(tmp_path / ".") == here
    other = tmp_path / "other"
    other.mkdir()
    elsewhere = partwrite.place_of(other)
    assert elsewhere is not None and elsewhere != here
    assert partwrite.place_of(tmp_path / "missing") is None
    # Rank 2 is on another host (its path is another folder, or none), rank 3 sees rank 0's.
    places = [here, here, elsewhere, here, None]
    assert partwrite.choose(places, [True] * 5) == (0, 1, 3)
    assert partwrite.choose(places, [True, False, True, True, True]) == (0, 3)
    # Rank 0's torch cannot place a frame's tensors, or its folder is unknown: rank 0 alone.
    assert partwrite.choose(places, [False] * 5) == (0,)
    assert partwrite.choose([None, here], [True, True]) == (0,)
    assert partwrite.offsets_supported()  # this torch: the shares are used


def test_a_share_is_never_written_into_another_file_than_rank_0s(tmp_path: Path) -> None:
    model, optimizer = _trained()
    copies = [partwrite.PartCopy(), partwrite.PartCopy()]
    shares = [copies[rank].take(model, optimizer, _side() if rank == 0 else {}, rank=rank,
                                ranks=2) for rank in (0, 1)]
    job = partwrite.start(shares[0], directory=tmp_path, step=2, keep=1, rank=0, group=None)
    assert job.temporary is not None and job.table is not None and job.file is not None
    before = job.temporary.read_bytes()
    with pytest.raises(TrainFailure, match="another file for this rank than for rank 0"):
        partwrite.write_share(job.temporary, job.table, shares[1].mine, (0, 0))
    assert job.temporary.read_bytes() == before
    partwrite.write_share(job.temporary, job.table, shares[1].mine, job.file)
    assert job.run(lambda: None) == tmp_path / "step-00000002.pt"


def test_a_spare_that_is_a_link_is_never_written_through(tmp_path: Path) -> None:
    model, optimizer = _trained()
    victim = tmp_path / "elsewhere.bin"
    victim.write_bytes(b"not a checkpoint")
    partwrite.spare_in(tmp_path).symlink_to(victim)
    copies = [partwrite.PartCopy(), partwrite.PartCopy()]
    path = _two_ranks(model, optimizer, tmp_path, 7, copies)
    assert path is not None and not path.is_symlink() and checkpoint.incomplete(path) is None
    assert victim.read_bytes() == b"not a checkpoint"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_spare_of_another_user_or_with_a_second_name_is_never_written_into(
        tmp_path: Path) -> None:
    # A labmate who can write the checkpoint folder plants a file of theirs (writable by all)
    # where rank 0 keeps its spare: it is left as it is and the checkpoint goes to a new file.
    model, optimizer = _trained()
    spare = partwrite.spare_in(tmp_path)
    spare.write_bytes(b"a labmate's file")
    spare.chmod(0o666)
    os.chown(spare, 4242, 4242)
    copies = [partwrite.PartCopy(), partwrite.PartCopy()]
    path = _two_ranks(model, optimizer, tmp_path, 7, copies)
    assert path is not None and checkpoint.incomplete(path) is None
    assert spare.read_bytes() == b"a labmate's file" and spare.stat().st_uid == 4242
    # One of this user's files given a second name there (a hard link) is not written through.
    spare.unlink()
    mine = tmp_path / "notes.txt"
    mine.write_bytes(b"my notes")
    os.link(mine, spare)
    path = _two_ranks(model, optimizer, tmp_path, 8, copies)
    assert path is not None and checkpoint.incomplete(path) is None
    assert mine.read_bytes() == b"my notes"
