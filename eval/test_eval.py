"""Unit tests of the GPU harness's pure parts, run on any machine (eval/tests/python.rs runs them
under `cargo test`): the bench's plan and shards, the in-process A/B's pairing, the reaping of a
restored job, the report's metrics.

    python3 eval/test_eval.py
"""
import argparse, os, statistics, subprocess, sys, time, unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import overhead  # noqa: E402
import report  # noqa: E402


def plan_args(**kw):
    a = dict(bench_jobs=None, bench_plan=ckpt.DEFAULT_PLAN, gib="8,32", shard="",
             engines="driver,possum", reps=2)
    a.update(kw)
    return argparse.Namespace(**a)


class Plan(unittest.TestCase):
    def test_default_plan_covers_every_workload_smallest_first(self):
        cells = ckpt.plan_cells(plan_args())
        self.assertEqual({j for j, _ in cells}, {"mlp", "cnn", "gpt2", "triton", "graph", "multistream"})
        self.assertEqual([g for _, g in cells], sorted(g for _, g in cells))
        self.assertIn(("mlp", 32.0), cells)

    def test_shards_split_the_full_matrix_exactly_and_evenly(self):
        full = ckpt.plan_cells(plan_args(bench_plan="full"))
        self.assertEqual(len(full), 18)
        shards = [ckpt.plan_cells(plan_args(bench_plan="full", shard=f"{k}/3")) for k in (1, 2, 3)]
        self.assertEqual(sorted(c for s in shards for c in s), sorted(full))
        a = plan_args()
        cost = [sum(ckpt.cell_cost(e, g, ckpt.cell_reps(a, e, g)) for _, g in s for e in ("driver", "possum"))
                for s in shards]
        # Each under the bench's default budget, and none much above the others.
        self.assertLess(max(cost), 600)
        self.assertLess(max(cost) - min(cost), 0.2 * max(cost))

    def test_bench_jobs_cross_gib(self):
        cells = ckpt.plan_cells(plan_args(bench_jobs="mlp,cnn", gib="1,8"))
        self.assertEqual(sorted(cells), [("cnn", 1.0), ("cnn", 8.0), ("mlp", 1.0), ("mlp", 8.0)])


class AB(unittest.TestCase):
    def steps(self, switches, slow_on, drift):
        """Step end times of a job whose step time drifts from 3 to 3 - 2*drift ms over 2 s and
        is `slow_on` times longer while the hooks are on."""
        def on_at(t):
            on = True
            for sw in switches:
                if sw["t"] <= t:
                    on = sw["on"]
            return on
        ts, t = [0.0], 0.0
        while t < 2.0:
            base = 3.0 - drift * t
            t += base * (slow_on if on_at(t) else 1.0) / 1e3
            ts.append(t)
        return ts

    def test_pairs_recover_the_cost_despite_drift(self):
        sw, t, on = [], 0.25, False
        while t < 2.0:
            sw.append({"t": t, "on": on})
            on, t = not on, t + 0.25
        pairs = overhead.ab_pairs(self.steps(sw, 1.05, drift=0.5), sw, 0)
        self.assertGreaterEqual(len(pairs), 3)
        est = statistics.median(100 * (a / b - 1) for a, b in pairs)
        self.assertAlmostEqual(est, 5.0, delta=0.5)
        # No cost, strong drift: no overhead found.
        pairs = overhead.ab_pairs(self.steps(sw, 1.0, drift=1.0), sw, 0)
        self.assertAlmostEqual(statistics.median(100 * (a / b - 1) for a, b in pairs), 0.0, delta=0.5)

    def test_intervals_start_on(self):
        ivs = overhead.ab_intervals([{"t": 1.0, "on": False}, {"t": 2.0, "on": True}], 0.0)
        self.assertEqual([(a, b, on) for a, b, on in ivs][:2], [(0.0, 1.0, True), (1.0, 2.0, False)])
        self.assertTrue(ivs[-1][2])


class Reap(unittest.TestCase):
    def test_a_killed_orphan_is_reaped(self):
        ckpt.become_subreaper()
        out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True,
                             text=True).stdout
        pid = int(out.strip())
        deadline = time.time() + 5
        while time.time() < deadline and not os.path.exists(f"/proc/{pid}"):
            time.sleep(0.01)
        self.assertTrue(ckpt.alive(pid))
        ckpt.kill_job(None, pid)
        # Reaped: the pid is free (no zombie left holding it).
        self.assertFalse(os.path.exists(f"/proc/{pid}"))


class Report(unittest.TestCase):
    def test_driver_throughput_counts_the_whole_gpu_state(self):
        gb = 3e9
        runs = [
            {"job": "gpt2", "engine": "possum", "gib": 1.0, "state": "s", "normal_step_ms": 60.0,
             "checkpoint": {"gpu_image_bytes": gb}, "restore": {"resume_ms": 200.0}},
            {"job": "gpt2", "engine": "driver", "gib": 1.0, "state": "s", "normal_step_ms": 59.0,
             "restore": {"driver_restore_ms": 1000.0}},
        ]
        s = report.summarise({"runs": runs})
        self.assertAlmostEqual(s[(("gpt2", 1.0), "driver")]["restore_gbps"][0], 3.0)
        self.assertAlmostEqual(s[(("gpt2", 1.0), "possum")]["restore_gbps"][0], 15.0)
        self.assertAlmostEqual(s[(("gpt2", 1.0), "possum")]["overhead_pct"][0], 100 * (60 / 59 - 1))


if __name__ == "__main__":
    unittest.main()
