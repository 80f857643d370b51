"""How ``coordl analyze`` combines the results its ranks (or an hp_group's members) wrote for a phase."""

from coordl.analyzer import runner


def _rank(**rates) -> dict:
    return {"phase": "rates", "S": 100.0, "C": 1000.0, "P": 500.0, "L": 0.001, "prep_cpu_s": 0.002,
            "local_world_size": 2, **rates}


def test_the_job_goes_at_its_slowest_ranks_rates_and_r_is_the_slowest_measured():
    """Two ranks of one server: the slower rank's S and P, the longer miss wait; R from the rank that fetched
    from a peer (the other's part of the next server's cache was empty), not none at all."""
    combined = runner._combine([_rank(S=90.0, R=3000.0, L=0.002), _rank(P=450.0, R=None)])
    assert (combined["S"], combined["P"], combined["L"], combined["R"]) == (90.0, 450.0, 0.002, 3000.0)
    assert len(combined["ranks"]) == 2
    assert runner._combine([_rank(R=None), _rank(R=None)])["R"] is None


def test_the_hit_fractions_are_the_ranks_mean():
    ranks = [{"phase": "run", "samples_per_s": 300.0, "hit_fraction": 0.4, "peer_hit_fraction": 0.5,
              "local_world_size": 2},
             {"phase": "run", "samples_per_s": 280.0, "hit_fraction": 0.6, "peer_hit_fraction": 0.3,
              "local_world_size": 2}]
    combined = runner._combine(ranks)
    assert combined["samples_per_s"] == 280.0
    assert (combined["hit_fraction"], combined["peer_hit_fraction"]) == (0.5, 0.4)


def test_the_waits_are_the_ranks_mean_and_a_wait_a_rank_did_not_time_is_none():
    """A rank whose loop ran through a torch iterator over the loader's parts (Accelerate) timed no stall:
    the job's stall is then not known, and the measured split is left out, not computed from the others."""
    from coordl.analyzer import report

    def run(stall):
        return {"phase": "run", "samples_per_s": 300.0, "local_world_size": 2, "step_samples_per_s": 900.0,
                "waits_s": {"stall": stall, "storage": 0.002, "peers": 0.0, "prep": 0.004}}

    timed = runner._combine([run(0.001), run(0.003)])["waits_s"]
    assert timed["stall"] == 0.002 and timed["prep"] == 0.004
    untimed = runner._combine([run(0.001), run(None)])
    assert untimed["waits_s"]["stall"] is None and untimed["waits_s"]["storage"] == 0.002
    assert report.measured_stall(None, untimed) is None
