"""The rehearsal buffer's statistics and the batches of a loader over an experience stream, in process."""

import itertools
import math
import pickle

import numpy as np
import pytest
import torch
import torch.utils.data

import coordl
from coordl._rehearsal.buffer import RehearsalBuffer, draw
from coordl._rehearsal.stream import Replayed

pytestmark = pytest.mark.filterwarnings("ignore:coordl cannot cache ExperienceStream")


def chi_square_bound(dof: int, z: float = 3.29) -> float:
    """The chi-square statistic a uniform draw exceeds with probability about 0.0005 (z = 3.29), by
    Wilson and Hilferty's approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(observed: np.ndarray) -> float:
    expected = observed.sum() / len(observed)
    return float(((observed - expected) ** 2 / expected).sum())


def test_a_reservoir_keeps_every_sample_offered_with_the_same_probability():
    n, k, trials = 100, 10, 2000
    held = np.zeros(n)
    for seed in range(trials):
        buffer = RehearsalBuffer(k, "reservoir", seed)
        for i in range(n):
            buffer.offer(i)
        assert len(buffer) == k and len(set(buffer.items)) == k
        held[buffer.items] += 1
    assert chi_square(held) < chi_square_bound(n - 1)


def test_the_uniformity_check_catches_a_buffer_that_keeps_the_first_samples():
    held = np.zeros(100)
    for _ in range(2000):
        held[:10] += 1  # what a buffer that never replaces would hold
    assert chi_square(held) > chi_square_bound(99)


@pytest.mark.parametrize("policy", ["class_balanced", "experience_balanced"])
def test_balanced_buffers_hold_floor_or_ceil_of_k_over_groups_after_each_experience(policy):
    k, per_class = 200, 120
    buffer = RehearsalBuffer(k, policy, seed=3)
    rng = np.random.default_rng(0)
    group_of = []
    for experience in range(5):
        classes = [2 * experience, 2 * experience + 1]
        labels = rng.permutation(np.repeat(classes, per_class))  # shuffled, as an epoch draws them
        for label in labels:
            group_of.append(int(label) if policy == "class_balanced" else experience)
            buffer.offer(len(group_of) - 1, group_of[-1])
        counts = buffer.counts()
        groups = 2 * (experience + 1) if policy == "class_balanced" else experience + 1
        assert len(counts) == groups and sum(counts.values()) == k
        assert set(counts.values()) <= {k // groups, -(-k // groups)}, counts
    members = buffer.items
    assert len(set(members)) == k  # each sample once
    for slot, member in enumerate(members):  # each member's group is its own
        assert buffer.groups[slot] == group_of[member]


@pytest.mark.parametrize("ranks", [1, 3])
def test_draws_are_distinct_uniform_over_the_union_and_leave_out_the_batch_s_own_samples(ranks):
    buffers = [RehearsalBuffer(20 // ranks + 1, "reservoir", seed=k) for k in range(ranks)]
    for i in range(21):
        buffers[i % ranks].offer(i)
    rng = np.random.default_rng(0)
    drawn = np.zeros(21)
    for _ in range(3000):
        replays = draw(buffers, 5, [0, 1, 2], rng)
        assert len(replays) == 5 and len(set(replays)) == 5 and not {0, 1, 2} & set(replays)
        drawn[replays] += 1
    assert drawn[:3].sum() == 0
    assert chi_square(drawn[3:]) < chi_square_bound(17)
    assert sorted(draw(buffers, 50, [], rng)) == list(range(21))  # all of them while fewer than r are held
    assert draw([RehearsalBuffer(5, "reservoir", 0)], 3, [], rng) == []


@pytest.mark.parametrize("policy", ["reservoir", "class_balanced"])
def test_a_buffer_set_to_a_saved_state_makes_the_same_offers_and_draws(policy):
    a = RehearsalBuffer(30, policy, seed=7)
    for i in range(100):
        a.offer(i, i % 4)
    b = RehearsalBuffer(30, policy, seed=99)
    b.set_state(pickle.loads(pickle.dumps(a.state())))
    for i in range(100, 300):
        assert a.offer(i, i % 5) == b.offer(i, i % 5)
    assert a.state() == b.state() and a.items == b.items
    with pytest.raises(ValueError, match="capacity=30"):
        RehearsalBuffer(31, policy, 0).set_state(a.state())


# -- a loader over a stream, in this process ---------------------------------------------------------------

class Labelled(torch.utils.data.Dataset):
    """Samples that are their own number, with a class; ``raw_key`` names the file coordl would read."""

    def __init__(self, first: int, n: int, classes: list[int], files: list[str] | None = None):
        self.first, self.n, self.targets = first, n, [classes[i % len(classes)] for i in range(n)]
        self.files = files

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.first + i, self.targets[i]


def stream_of(sizes=(40, 40, 40), tagged=False) -> coordl.ExperienceStream:
    parts, first = [], 0
    for number, n in enumerate(sizes):
        parts.append(Labelled(first, n, [2 * number, 2 * number + 1]))
        first += n
    return coordl.ExperienceStream(parts, tagged=tagged)


def run(loader, stream, epochs: int = 2) -> list[list[list[int]]]:
    """Every batch's sample numbers, per epoch, over every experience."""
    passes = []
    for _ in stream:
        for _ in range(epochs):
            passes.append([x.tolist() for x, _ in loader])
    return passes


def test_every_batch_is_b_new_samples_of_the_current_experience_and_r_replayed():
    stream = stream_of()
    b, r = 8, 4
    loader = coordl.DataLoader(stream, batch_size=b, shuffle=True, rehearsal=coordl.Rehearsal(16, per_batch=r, seed=0),
                               generator=torch.Generator().manual_seed(0))
    passes = run(loader, stream)
    assert len(passes) == 6
    for number, epoch in enumerate(passes):
        experience = range(40 * (number // 2), 40 * (number // 2 + 1))
        new = [i for batch in epoch for i in batch[:b]]
        assert sorted(new) == list(experience)  # every new sample once per epoch
        for batch in epoch:
            replayed = batch[b:]
            assert len(replayed) == (0 if number == 0 else r)  # nothing to replay before the first epoch ends
            assert len(set(batch)) == len(batch)
            assert all(i < experience.stop for i in replayed)
    assert passes[2] != passes[3] and sorted(sum(passes[2], [])) != sorted(sum(passes[3], []))  # new orders, new draws
    epochs = loader.stats().epochs
    assert [e.experience for e in epochs] == [0, 0, 1, 1, 2, 2]
    assert [e.replayed for e in epochs] == [0, 20, 20, 20, 20, 20]
    assert all(e.buffer_items == 16 for e in epochs)


def test_on_sight_admission_replays_within_the_first_epoch():
    stream = stream_of((40,))
    loader = coordl.DataLoader(stream, batch_size=8, rehearsal=coordl.Rehearsal(16, per_batch=4, admit="on_sight",
                                                                                  seed=0))
    batches = [x.tolist() for x, _ in loader]
    assert [len(batch) for batch in batches] == [8, 12, 12, 12, 12]  # the first batch had nothing to replay
    assert all(set(batch[8:]) <= set(sum((b[:8] for b in batches[:k]), [])) for k, batch in enumerate(batches))


def test_a_tagged_stream_says_which_samples_were_replayed_and_from_which_experience():
    stream = stream_of((16, 16), tagged=True)
    loader = coordl.DataLoader(stream, batch_size=4, rehearsal=coordl.Rehearsal(8, ratio=0.5, seed=0))
    for experience in stream:
        for x, y, replayed, number in loader:
            assert replayed.tolist() == [False] * 4 + [True] * (len(x) - 4)
            assert number[:4].tolist() == [experience.number] * 4
            assert (number[4:] < 1).all() if experience.number == 1 else len(x) == 4


def test_the_same_seeds_give_the_same_batches_and_buffer():
    def once():
        torch.manual_seed(5)
        stream = stream_of()
        loader = coordl.DataLoader(stream, batch_size=8, shuffle=True,
                                   rehearsal=coordl.Rehearsal(10, "class_balanced", per_batch=3))
        return run(loader, stream), loader.rehearsal.members()
    assert once() == once()


def test_a_resumed_pass_gives_the_rest_of_the_uninterrupted_one_and_the_same_buffer_after():
    def loader_over(stream):
        return coordl.DataLoader(stream, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1),
                                 rehearsal=coordl.Rehearsal(12, per_batch=4, seed=2))
    stream = stream_of()
    whole = loader_over(stream)
    reference = run(whole, stream)

    stream = stream_of()
    first = loader_over(stream)
    seen = []
    for experience in stream:
        seen.append([x.tolist() for x, _ in first])  # experience 0, epoch 1
        it = iter(first)
        seen.append([next(it)[0].tolist() for _ in range(2)])
        break
    state = pickle.loads(pickle.dumps(first.state_dict()))
    stream = stream_of()  # a new job
    resumed = loader_over(stream)
    resumed.load_state_dict(state)
    assert stream.current == 0
    rest = [x.tolist() for x, _ in resumed]
    assert seen[1] + rest == reference[1]
    later = []
    for _ in stream:
        if stream.current == 0:
            continue
        for _ in range(2):
            later.append([x.tolist() for x, _ in resumed])
    assert later == reference[2:]
    assert resumed.rehearsal.members() == whole.rehearsal.members()


def test_a_torch_loader_rebuilt_from_the_parts_and_a_pickled_loader_replay_too():
    stream = stream_of((24, 24))
    loader = coordl.DataLoader(stream, batch_size=6, rehearsal=coordl.Rehearsal(6, per_batch=2, seed=0))
    run(loader, stream, epochs=1)
    stream.current = 1
    rebuilt = torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                          collate_fn=loader.collate_fn)
    assert [len(x) for x, _ in rebuilt] == [8] * 4
    relit = coordl.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler)  # Lightning's re-creation
    assert relit.rehearsal is loader.rehearsal and [len(x) for x, _ in relit] == [8] * 4
    copy = pickle.loads(pickle.dumps(loader))  # ddp_spawn
    assert [len(x) for x, _ in copy] == [8] * 4
    assert loader.stats().epochs[-1].replayed == 8


def test_without_rehearsal_a_stream_loader_draws_the_current_experience_alone():
    stream = stream_of((10, 20))
    loader = coordl.DataLoader(stream, batch_size=None)
    assert [x for x, _ in loader] == list(range(10))
    stream.current = 1
    assert len(loader) == 20 and [x for x, _ in loader] == list(range(10, 30))
    assert len(torch.utils.data.DataLoader(stream)) == 30  # as a dataset: every experience, jointly
    batched = coordl.DataLoader(stream, batch_size=4)
    assert [len(x) for x, _ in batched] == [4] * 5
    assert batched.stats().epochs[-1].experience == 1 and batched.stats().rehearsal is None


def test_a_loader_refuses_what_a_stream_cannot_do_naming_it():
    stream = stream_of((10,))
    with pytest.raises(ValueError, match="per_batch=9 replayed samples is more than batch_size=8"):
        coordl.DataLoader(stream, batch_size=8, rehearsal=coordl.Rehearsal(4, per_batch=9))
    with pytest.raises(ValueError, match="needs a coordl.ExperienceStream"):
        coordl.DataLoader(list(range(10)), batch_size=8, rehearsal=coordl.Rehearsal(4, per_batch=2))
    with pytest.raises(ValueError, match="sampler= \\(SequentialSampler\\)"):
        coordl.DataLoader(stream, sampler=torch.utils.data.SequentialSampler(stream))
    with pytest.raises(ValueError, match="rehearsal= needs batch_size="):
        coordl.DataLoader(stream, batch_size=None, rehearsal=coordl.Rehearsal(4, per_batch=2))
    unlabelled = coordl.ExperienceStream([list(range(5))])
    with pytest.raises(ValueError, match="experience 0 \\(list\\) has no targets"):
        coordl.DataLoader(unlabelled, batch_size=2, rehearsal=coordl.Rehearsal(4, "class_balanced", per_batch=1))
    for bad, match in ((dict(capacity=0, per_batch=1), "capacity"), (dict(capacity=4), "give one of"),
                       (dict(capacity=4, per_batch=1, policy="fifo"), "policy"),
                       (dict(capacity=4, ratio=2.0), "ratio"), (dict(capacity=4, per_batch=1, admit="never"), "admit")):
        with pytest.raises(ValueError, match=match):
            coordl.Rehearsal(**bad)
    with pytest.raises(ValueError, match="is empty"):
        coordl.ExperienceStream([[]])


def test_an_experience_added_after_the_loader_was_built_asks_for_a_new_loader():
    stream = stream_of((8,))
    rehearsal = coordl.Rehearsal(4, per_batch=2, seed=0)
    loader = coordl.DataLoader(stream, batch_size=4, rehearsal=rehearsal)
    run(loader, stream, epochs=1)
    stream.add(Labelled(8, 8, [2, 3]))
    stream.current = 1
    with pytest.raises(RuntimeError, match="experience 1 was added after this loader was built"):
        list(loader)
    again = coordl.DataLoader(stream, batch_size=4, rehearsal=rehearsal)
    assert [len(x) for x, _ in again] == [6, 6]
    assert isinstance(next(iter(again.batch_sampler))[-1], Replayed)


def test_under_ddp_each_rank_draws_its_share_and_every_rank_holds_the_same_buffers():
    ranks = []
    for rank in range(2):
        stream = stream_of((64, 64))
        sampler = torch.utils.data.distributed.DistributedSampler(stream, num_replicas=2, rank=rank, seed=3)
        loader = coordl.DataLoader(stream, batch_size=8, sampler=sampler,
                                   rehearsal=coordl.Rehearsal(20, "class_balanced", per_batch=4, seed=1))
        passes = []
        for _ in stream:
            for epoch in range(2):
                loader.sampler.set_epoch(epoch)  # as a DDP script (or Lightning) does
                passes.append([x.tolist() for x, _ in loader])
        ranks.append((passes, loader))
    (mine, first), (theirs, second) = ranks
    assert len(first) == 4 and all(len(batch) == 12 for batch in mine[1] + mine[2])
    for number, (a, b) in enumerate(zip(mine, theirs)):
        new = sorted(i for batch in a + b for i in batch[:8])
        assert new == list(range(64 * (number // 2), 64 * (number // 2 + 1)))  # the experience, shared out once
    assert mine[0] != mine[1]  # set_epoch reached the share
    assert first.rehearsal.members() == second.rehearsal.members()  # the same buffers on every rank
    assert first.stats().rehearsal["ranks"] == [10, 10]
    assert [sum(b[8:] == c[8:] for b, c in zip(x, y)) for x, y in zip(mine[1:], theirs[1:])] != [4, 4, 4]  # own draws


def test_under_ddp_replays_are_uniform_over_the_union_of_the_ranks_buffers():
    stream = stream_of((200, 40))
    sampler = torch.utils.data.distributed.DistributedSampler(stream, num_replicas=2, rank=1, seed=0)
    rehearsal = coordl.Rehearsal(40, per_batch=4, seed=2)
    loader = coordl.DataLoader(stream, batch_size=4, sampler=sampler, rehearsal=rehearsal)
    list(loader)
    union = rehearsal.members()
    assert len(union) == 40 and len(rehearsal.buffers[0]) == len(rehearsal.buffers[1]) == 20
    stream.current = 1
    counts = dict.fromkeys(union, 0)
    for _ in range(100):  # each pass short of its last batch, whose drawing would admit the pass's samples
        for batch in itertools.islice(loader.batch_sampler, len(loader) - 1):
            for i in batch[4:]:
                counts[i] += 1
    assert rehearsal.members() == union
    assert chi_square(np.array(list(counts.values()), dtype=float)) < chi_square_bound(len(union) - 1)


def test_a_framework_re_creating_the_loader_around_a_distributed_sampler_keeps_the_rehearsal():
    stream = stream_of((32,))
    loader = coordl.DataLoader(stream, batch_size=4, rehearsal=coordl.Rehearsal(8, per_batch=2, seed=0))
    sampler = torch.utils.data.distributed.DistributedSampler(loader.dataset, num_replicas=2, rank=0)
    from coordl._epochs.batch_sampler import EpochBatchSampler
    relit = coordl.DataLoader(loader.dataset, batch_sampler=EpochBatchSampler(sampler, 4, False),
                              rehearsal=loader.rehearsal)  # Lightning's re-instantiation under DDP
    assert len(relit) == 4 and all(len(x) == 4 for x, _ in relit)
    assert [len(x) for x, _ in relit] == [6, 6, 6, 6] and len(relit.rehearsal.buffers) == 2
