"""Unit tests of the GPU harness's pure parts, run on any machine (eval/tests/python.rs runs them
under `cargo test`): the bench's plan and shards, the engine variants and job specs (their
environments), the correctness trials' plan, the figures' plan and budget, the time until every
buffer is back, the coverage check's arithmetic, the in-process A/B's pairing, the reaping of a
restored job, the report's metrics.

    python3 eval/test_eval.py
"""
import argparse, json, os, statistics, subprocess, sys, time, unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import hooks_coverage as coverage  # noqa: E402
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

    def test_pool_takes_every_pair_of_like_files_only(self):
        doc = lambda pairs, gpu="H200": {"job": "gpt2", "ab_ms": 400, "gpu": gpu, "runs": [{"pairs": pairs}]}
        o = overhead.pool([doc([(101.0, 100.0), (102.0, 100.0)]), doc([(103.0, 100.0)])])
        self.assertEqual((o["pairs"], o["processes"]), (3, 2))
        self.assertAlmostEqual(o["overhead_pct_median"], 2.0)
        self.assertLessEqual(o["ci95_pct"][0], o["overhead_pct_median"])
        with self.assertRaisesRegex(ValueError, "GPU model"):
            overhead.pool([doc([(101.0, 100.0)]), doc([(101.0, 100.0)], gpu="H100")])
        with self.assertRaisesRegex(ValueError, "no interval pair"):
            overhead.pool([doc([])])

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


class Variants(unittest.TestCase):
    def test_possum_is_the_default_hooks_and_no_engine_flag(self):
        v = ckpt.variant("possum")
        self.assertEqual((v["ckpt"], v["possum"], v["env"], v["frozen"]), ("possum", True, {}, False))
        self.assertEqual(ckpt.ckpt_flags("possum"), [])
        self.assertEqual(ckpt.ckpt_flags("driver"), ["--engine", "driver"])
        self.assertEqual(ckpt.ckpt_flags("gpu-only"), ["--gpu-only"])

    def test_hold_cupti_frozen_driver(self):
        h = ckpt.variant("possum-hold")
        self.assertEqual((h["ckpt"], h["env"]), ("possum", {"POSSUM_HOOKS": "off"}))
        f = ckpt.variant("possum-hold-frozen")
        self.assertEqual((f["base"], f["frozen"], f["env"]), ("possum-hold", True, {"POSSUM_HOOKS": "off"}))
        c = ckpt.variant("gpu-only-cupti")
        self.assertEqual((c["ckpt"], c["env"]["POSSUM_HOOKS"]), ("gpu-only", "cupti"))
        self.assertTrue(c["env"]["POSSUM_CUPTI"])
        d = ckpt.variant("driver-frozen")
        self.assertEqual((d["ckpt"], d["possum"], d["env"], d["frozen"]), ("driver", False, {}, True))
        n = ckpt.variant("possum-none")
        self.assertEqual((n["ckpt"], n["possum"]), (None, True))
        self.assertEqual(ckpt.variant("gpu-only-frozen")["base"], "gpu-only")
        for bad in ("possum-nocupti", "cupti", "driver-cupti", "possum-hold-cupti"):
            with self.assertRaises(ValueError):
                ckpt.variant(bad)

    def test_kill_and_disk(self):
        k = ckpt.variant("possum-keeper-kill")
        self.assertEqual((k["base"], k["kill"], k["disk"]), ("possum-keeper", True, False))
        self.assertEqual(k["env"]["POSSUM_KEEPER"], ckpt.KEEPER_DIR)
        d = ckpt.variant("possum-keeper-kill-disk-frozen")
        self.assertEqual((d["base"], d["kill"], d["disk"], d["frozen"]), ("possum-keeper", True, True, True))
        self.assertFalse(ckpt.variant("driver")["kill"])
        self.assertTrue(ckpt.variant("driver-kill")["kill"])
        n = ckpt.variant("possum-keeper-kill-disk-nostage")
        self.assertEqual((n["base"], n["kill"], n["disk"], n["nostage"]), ("possum-keeper", True, True, True))
        self.assertFalse(d["nostage"])
        for bad in ("possum-keeper-disk", "possum-kill-cupti-x", "possum-keeper-kill-nostage"):
            with self.assertRaises(ValueError):
                ckpt.variant(bad)

    def test_migrate(self):
        m = ckpt.variant("possum-keeper-migrate")
        self.assertEqual((m["base"], m["migrate"], m["kill"], m["ckpt"]), ("possum-keeper", True, False, "possum"))
        self.assertFalse(ckpt.variant("possum-keeper")["migrate"])
        for bad in ("driver-migrate", "possum-keeper-migrate-kill", "gpu-only-migrate"):
            with self.assertRaises(ValueError):
                ckpt.variant(bad)

    def test_speculation_and_no_shadows(self):
        v = ckpt.variant("possum-keeper-spec-noshadow")
        self.assertEqual((v["base"], v["noshadow"], v["env"]["POSSUM_VALIDATE"]),
                         ("possum-keeper", True, "readonly_after=2"))
        self.assertEqual(v["env"]["POSSUM_KEEPER"], ckpt.KEEPER_DIR)
        n = ckpt.variant("possum-keeper-noshadow")
        self.assertEqual((n["noshadow"], "POSSUM_VALIDATE" in n["env"]), (True, False))
        self.assertFalse(ckpt.variant("possum-keeper")["noshadow"])
        for bad in ("driver-noshadow", "driver-spec", "possum-noshadow-spec"):
            with self.assertRaises(ValueError):
                ckpt.variant(bad)

    def test_job_env_drops_inherited_choices(self):
        saved = dict(os.environ)
        try:
            os.environ.update(POSSUM_HOOKS="off", POSSUM_CUPTI="off", PYTORCH_CUDA_ALLOC_CONF="x",
                              POSSUM_RESOLVE="always")
            e = ckpt.job_env(True)
            self.assertNotIn("POSSUM_HOOKS", e)
            self.assertNotIn("POSSUM_CUPTI", e)
            self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", e)
            self.assertEqual(e["POSSUM_RESOLVE"], "always")
            self.assertEqual(e["LD_PRELOAD"], ckpt.SO)
            e = ckpt.job_env(False, {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
            self.assertNotIn("LD_PRELOAD", e)
            self.assertEqual(e["PYTORCH_CUDA_ALLOC_CONF"], "backend:cudaMallocAsync")
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def test_job_specs(self):
        self.assertEqual(ckpt.job_spec("mlp"), ("mlp", {}))
        self.assertEqual(ckpt.job_spec("mlp+expandable"), ("mlp", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))
        self.assertEqual(ckpt.job_spec("gpt2+async"), ("gpt2", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}))
        self.assertEqual(ckpt.job_spec("gpt2+vmm"), ("gpt2", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                                              "POSSUM_SERVE_VMM": "1"}))
        self.assertEqual(ckpt.job_spec("mlp+pools")[1]["POSSUM_SERVE_POOLS"], "1")
        self.assertEqual(ckpt.job_spec("gpt2+async-driver"), ("gpt2", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync",
                                                                       "POSSUM_SERVE_POOLS": "0"}))
        self.assertEqual(ckpt.job_spec("cnn+garbage_collection_threshold:0.6"),
                         ("cnn", {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}))
        with self.assertRaises(ValueError):
            ckpt.job_spec("lcuda+async")
        self.assertEqual(ckpt.job_cmd("lcuda", 5, "L", sleep_ms=3)[1:], ["5", "L", "3"])


class Correctness(unittest.TestCase):
    def test_every_job_before_any_repeats_with_k_in_range(self):
        jobs = ckpt.CORRECTNESS_JOBS.split(",")
        for spec in jobs:
            self.assertIn(ckpt.job_spec(spec)[0], ckpt.JOB_STEPS)
        plan = ckpt.trial_plan(jobs, 20, 4)
        self.assertEqual(len(plan), 20)
        self.assertEqual([s for s, _ in plan[:len(jobs)]], jobs)
        for spec, k in plan:
            self.assertTrue(2 <= k <= ckpt.JOB_STEPS[ckpt.job_spec(spec)[0]] * 2 // 3)
        self.assertEqual(plan, ckpt.trial_plan(jobs, 20, 4))
        # Migrated: five times the steps, each held in their first third.
        self.assertEqual(ckpt.job_steps("gpt2", "possum-keeper-migrate"), 5 * ckpt.JOB_STEPS["gpt2"])
        self.assertEqual(ckpt.job_steps("gpt2", "possum-keeper"), ckpt.JOB_STEPS["gpt2"])
        for spec, k in ckpt.trial_plan(jobs, 20, 4, "possum-keeper-migrate-postcopy"):
            self.assertTrue(2 <= k <= ckpt.JOB_STEPS[ckpt.job_spec(spec)[0]] * 5 // 3)
        # Both allocator settings and the -lcuda program are in the default jobs.
        self.assertTrue({"mlp+expandable", "mlp+async", "lcuda"} <= set(jobs))
        # 20 trials fit one device call (10 minutes) with the references' start.
        self.assertLess(sum(ckpt.trial_cost(s) for s, _ in plan), 540)

    def test_engines_take_turns_each_plan_in_its_order(self):
        a = [("mlp", 5), ("gpt2", 9), ("mlp", 7)]
        b = [("gpt2", 3), ("mlp", 4)]
        self.assertEqual(ckpt.interleaved([a, b]), [
            (0, 0, "mlp", 5), (1, 0, "gpt2", 3), (0, 1, "gpt2", 9), (1, 1, "mlp", 4), (0, 2, "mlp", 7)])
        self.assertEqual(ckpt.interleaved([[], b]), [(1, 0, "gpt2", 3), (1, 1, "mlp", 4)])
        self.assertEqual(ckpt.interleaved([]), [])

    def test_a_budget_cut_short_leaves_each_engine_its_share(self):
        import types
        from unittest import mock
        clock = [0.0]
        ran = []

        def trial(spec, engine, k, steps, sleep, n):
            ran.append((engine, n))
            clock[0] += 10
            return True

        a = types.SimpleNamespace(jobs="mlp,gpt2", engines="possum-keeper-migrate,possum-keeper-migrate-postcopy",
                                  engine=None, trials="4,4", seed=1, parallel=1, budget_s=45)
        with mock.patch.multiple(ckpt, references=lambda _: None, ensure_keeper=lambda: None,
                                 trial=trial, trial_cost=lambda _: 10, write_correctness_md=lambda *_: None,
                                 rows_of=lambda *_: []), \
                mock.patch.object(ckpt, "time", types.SimpleNamespace(time=lambda: clock[0])):
            self.assertFalse(ckpt.correctness(a))  # trials were left out
        self.assertEqual(ran, [("possum-keeper-migrate", 0), ("possum-keeper-migrate-postcopy", 100),
                               ("possum-keeper-migrate", 1), ("possum-keeper-migrate-postcopy", 101)])

    def test_longest_gap_names_the_step_it_followed(self):
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
            for step, t in enumerate([0.0, 0.5, 0.6, 2.6, 2.7]):
                f.write(json.dumps({"step": step, "t": t}) + "\n")
        try:
            self.assertEqual(ckpt.longest_gap(f.name), {"s": 2.0, "after_step": 2, "steps_after": 2,
                                                        "before_s": [0.5, 0.1], "after_s": [0.1]})
        finally:
            os.unlink(f.name)

    def test_criu_logs_kept_only_from_criu_directories_when_asked(self):
        import tempfile
        from unittest import mock
        with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory() as into:
            for d, f in [("local/criu", "dump-7.log"), ("recv/img/criu", "restore-9.log"),
                         ("local/criu", "pages-1.img"), ("local", "receive.log")]:
                os.makedirs(os.path.join(work, d), exist_ok=True)
                open(os.path.join(work, d, f), "w").write(f)
            ckpt.keep_criu_logs(work, "e-0")  # CKPT_CRIU_LOGS unset: nothing
            self.assertEqual(os.listdir(into), [])
            with mock.patch.dict(os.environ, {"CKPT_CRIU_LOGS": into}):
                ckpt.keep_criu_logs(work, "e-0")
            self.assertEqual(sorted(os.listdir(os.path.join(into, "e-0"))),
                             ["local_criu_dump-7.log", "recv_img_criu_restore-9.log"])
            self.assertEqual(open(os.path.join(into, "e-0", "local_criu_dump-7.log")).read(), "dump-7.log")

    def test_table(self):
        rows = [{"trial": 0, "job": "mlp", "engine": "possum", "k": 5, "ok": True,
                 "leave_running_identical": True, "restored_identical": True, "resumed_at_step": 6,
                 "checkpoint": {"hooks": "entry", "figures": {"stall_ms": 900, "stall_breakdown_ms":
                                {"engine": 100, "driver": 500, "criu": 300}}},
                 "restore": {"figures": {"total_ms": 1200}}, "wall_s": 18},
                {"trial": 1, "job": "gpt2+async", "engine": "possum", "k": 9, "ok": False, "why": "checkpoint failed"},
                {"trial": 2, "job": "gpt2+async", "engine": "possum-keeper-kill", "k": 3, "ok": True,
                 "restore": {"figures": {"total_ms": 900}, "staged_buffers_mapped": 68, "peer_buffers": 58,
                             "peer_misses": ["buffer 7 at 0x7f00: nothing retained there", "buffer 9 ..."]}}]
        md = ckpt.correctness_md(rows, [{"engine": "possum", "ok": 1, "ran": 2, "asked": 3, "skipped": ["x"]}], 30)
        self.assertIn("possum: 1/2 bit-identical both ways (1 of 3 not started", md)
        self.assertIn("| 0 | mlp | possum | entry | 5 | yes | yes | 6 | 900 (100/500/300) | 1200 |", md)
        self.assertIn("checkpoint failed", md)
        # A move's buffers read from the image instead of copied GPU to GPU say why (the first).
        self.assertIn("| 900 (68 staged, 58 GPU to GPU); not copied: buffer 7 at 0x7f00: nothing retained there (+1) |", md)


class Figures(unittest.TestCase):
    def args(self, *argv):
        return ckpt.mode_defaults(ckpt.parser().parse_args(list(argv)))

    def test_figures_plan_fits_the_budget(self):
        a = self.args("figures")
        self.assertEqual(a.engines.split(","), ["possum", "possum-frozen", "driver", "possum-hold"])
        cells = ckpt.plan_cells(a)
        self.assertEqual(cells, [("mlp", 1.0), ("mlp", 8.0), ("mlp", 32.0)])
        cost = ckpt.plan_cost(a, cells, a.engines.split(","))
        # 8-9 minutes at most, with room for the estimate's error.
        self.assertLess(cost, 450)
        # The largest sizes last: a budget cut drops them first.
        self.assertEqual(cells[-1][1], 32.0)

    def test_mode_defaults(self):
        a = self.args("bench")
        self.assertEqual((a.engines, a.bench_plan), ("driver,possum", ckpt.DEFAULT_PLAN))
        a = self.args("correctness")
        self.assertEqual((a.engine, a.engines, a.jobs), ("possum", None, ckpt.CORRECTNESS_JOBS))
        a = self.args("figures", "--engines", "possum,driver", "--bench-plan", "mlp:1")
        self.assertEqual(ckpt.plan_cells(a), [("mlp", 1.0)])
        # The hold path costs more per GiB than possum, the driver most.
        self.assertLess(ckpt.cell_cost("possum", 32, 1), ckpt.cell_cost("possum-hold", 32, 1))
        self.assertLess(ckpt.cell_cost("possum-hold", 32, 1), ckpt.cell_cost("driver", 32, 1))
        self.assertEqual(ckpt.cell_reps(plan_args(reps=2), "driver-frozen", 32), 1)

    def test_buffers_back(self):
        rf = {"criu_restore_ms": 800, "driver_restore_ms": 300, "driver_unlock_ms": 2, "resume_ms": 20,
              "total_ms": 1150}
        self.assertEqual(ckpt.buffers_back_ms("driver", rf, None), 1150)
        self.assertEqual(ckpt.buffers_back_ms("possum", rf, {"ms": 2500, "on_demand": True}), 1150 - 20 + 2500)
        self.assertIsNone(ckpt.buffers_back_ms("possum", rf, None))
        self.assertIsNone(ckpt.buffers_back_ms("possum", {}, {"ms": 1}))

    def test_table(self):
        doc = {"date": "d", "gpu": "g", "wall_s": 10, "budget_s": 500, "runs": [
            {"job": "mlp", "engine": "possum-frozen", "gib": 32.0, "state": "frozen", "hooks": "entry", "ok": True,
             "stall_ms": 700.0, "possum_stall_ms": 690.0, "stall_parts_ms": {"engine": 50, "driver": 400, "criu": 250},
             "step_ms_during_save": {"median": 6.6, "steps": 200, "lost_ms": 950.0, "ratio": 1.1},
             "checkpoint_total_ms": 5000, "restore_to_first_step_ms": 1300, "buffers_back_ms": 3900,
             "restore": {"criu_restore_ms": 700, "driver_restore_ms": 400, "driver_unlock_ms": 3, "resume_ms": 30},
             "checkpoint": {"image_bytes": 36e9, "saved_ms": 1500},
             "kept": {"save": [{"bytes": 30e9}, {"bytes": 6e9}]}},
            {"job": "mlp", "engine": "driver", "gib": 32.0, "ok": False, "why": "restored job stopped"}],
            "skipped": [{"job": "mlp", "engine": "possum-hold", "gib": 32.0, "why": "time budget"}]}
        md = ckpt.figures_md(doc)
        # Drain: the saved bytes over saved_ms (36 GB in 1.5 s).
        self.assertIn("| mlp | possum-frozen | 32 | frozen | entry | 700 | 690 | 50 | 400 | 250 | 5000 | 1500 (24.0) "
                      "| 950 | 1.10x | 1300 | 3900 | 700 / 403 / 30 | 36.0 | yes |", md)
        self.assertIn("**NO** restored job stopped", md)
        self.assertIn("Not run: mlp possum-hold 32 GiB: time budget.", md)
        self.assertIn("- mlp possum-frozen: 32 GiB 700 / 1300", md)


class StepsDuringSave(unittest.TestCase):
    def test_the_steps_after_the_hold_for_the_save_and_the_time_lost(self):
        # 10 ms steps, a 1 s hold after t=0.99, then 20 ms steps.
        rows = [{"t": i * 0.01} for i in range(100)]
        rows += [{"t": 2.0 + i * 0.02} for i in range(50)]
        d = ckpt.steps_during_save(rows, 0.95, 2.5, 500, 10.0)
        self.assertEqual(d["steps"], 25)
        self.assertAlmostEqual(d["median"], 20.0, places=6)
        self.assertAlmostEqual(d["ratio"], 2.0, places=6)
        # The hold's gap beyond a step (1000 ms) and 25 steps 10 ms too long.
        self.assertAlmostEqual(d["lost_ms"], 1250.0, places=3)

    def test_nothing_to_say_without_a_save(self):
        self.assertEqual(ckpt.steps_during_save([{"t": 0.0}, {"t": 1.0}], 0.0, 1.0, None, 10.0)["steps"], 0)


class Coverage(unittest.TestCase):
    def stats(self, launches, nodes=0, captured=0, total=None, **kw):
        s = {"hooks": "entry", "total_launches": total if total is not None else launches + captured,
             "launches": {"cuLaunchKernel": launches, "cuLaunchKernelEx": 0},
             "possum": {"counters": {"launches": launches, "graph_nodes_expanded": nodes,
                                     "captured_launches": captured, "graph_launches": 20 if nodes else 0}},
             "entry": {"swapped_dlsym": 3, "unmatched": [], "seen_beside_cupti": {}}}
        s.update(kw)
        return s

    def test_graph_nodes_count_per_launch_and_captures_do_not(self):
        # FINDINGS' graph job: 32 launches run, 3 captured, 20 graph launches of 3 nodes: 92.
        row = coverage.coverage_row("graph", "default", self.stats(32, nodes=60, captured=3),
                                    {"profiler": {"kernels": 92}}, "a\n", "a\n")
        self.assertTrue(row["match"] and row["identical"])
        self.assertEqual((row["possum_kernels"], row["launch_calls"], row["captured"]), (92, 35, 3))
        row = coverage.coverage_row("mlp", "async", self.stats(770), {"profiler": {"kernels": 774}}, "a", "b")
        self.assertFalse(row["match"] or row["identical"])
        # No profile line (the run failed): no match.
        self.assertFalse(coverage.coverage_row("mlp", "default", self.stats(1), {}, "", "")["match"])

    def test_without_possum_state_every_call_counts(self):
        s = {"hooks": "entry", "total_launches": 12, "possum": {"counters": {}}}
        self.assertEqual(coverage.possum_kernels(s)[0], 12)

    def test_alloc_env(self):
        self.assertEqual(coverage.alloc_env("default"), {})
        self.assertEqual(coverage.alloc_env("expandable"), {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        self.assertEqual(coverage.alloc_env("async"), {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
        env = coverage.possum_env("/w/x.stats.json", hooks="cupti")
        self.assertEqual((env["POSSUM_HOOKS"], env["LD_PRELOAD"], env["POSSUM_STATS"]), ("cupti", coverage.SO, "/w/x.stats.json"))
        self.assertNotIn("POSSUM_HOOKS", coverage.possum_env("/w/y.json"))

    def test_cupti_cross_check(self):
        s = {"hooks": "cupti", "cupti": True, "launches": {"cuLaunchKernel": 594, "cuLaunchKernelEx": 180},
             "copies": {"cuMemcpyHtoDAsync_v2": 6}, "memsets": {"cuMemsetD8Async": 20}, "graphs": {},
             "entry": {"seen_beside_cupti": {"cuLaunchKernel": 594, "cuLaunchKernelEx": 180,
                                             "cuMemcpyHtoDAsync_v2": 6, "cuMemsetD8Async": 20,
                                             "cuGetProcAddress_v2": 1300}}}
        x = coverage.cupti_cross(s)
        self.assertTrue(x["match"])
        self.assertEqual(x["names"], 4)
        s["entry"]["seen_beside_cupti"]["cuLaunchKernelEx"] = 170
        x = coverage.cupti_cross(s)
        self.assertFalse(x["match"])
        self.assertEqual(x["differ"], {"cuLaunchKernelEx": {"cupti": 180, "entry": 170}})

    def test_lcuda_against_its_own_counts(self):
        own = {"calls": {"cuLaunchKernel": 40, "cuLaunchKernelEx": 20, "launches": 60, "cuMemcpyHtoD_v2": 6,
                         "cuMemsetD32_v2": 7}}
        s = {"hooks": "entry", "launches": {"cuLaunchKernel": 40, "cuLaunchKernelEx": 20},
             "copies": {"cuMemcpyHtoD_v2": 6}, "memsets": {"cuMemsetD32_v2": 7},
             "possum": {"counters": {"launches": 60}}}
        r = coverage.lcuda_row("", s, own, "x", "x")
        self.assertTrue(r["match"] and r["identical"])
        self.assertEqual(r["job"], "lcuda")
        s["memsets"]["cuMemsetD32_v2"] = 5
        r = coverage.lcuda_row("extra", s, own, "x", "x")
        self.assertEqual((r["job"], r["match"], r["differ"]), ("lcuda-extra", False,
                                                               {"cuMemsetD32_v2": {"own": 7, "possum": 5}}))

    def test_markdown(self):
        rows = [coverage.coverage_row("graph", "default", self.stats(32, nodes=60, captured=3),
                                      {"profiler": {"kernels": 92}}, "a", "a")]
        md = coverage.markdown({"rows": rows, "date": "d", "gpu": "g", "resolve": "always", "wall_s": 5,
                                "cupti_cross": {"job": "mlp", "match": True, "names": 4}, "skipped": []})
        self.assertIn("1/1 rows", md)
        self.assertIn("| graph | default | entry | 92 | 92 | yes | yes |", md)
        self.assertIn("entry wrappers = CUPTI for every one", md)


class OverheadModes(unittest.TestCase):
    def test_modes_choose_hooks_not_cupti_off(self):
        self.assertEqual(overhead.MODE_ENV["possum"], {})
        self.assertEqual(overhead.MODE_ENV["possum-hooksoff"], {"POSSUM_HOOKS": "off"})
        self.assertNotIn("off", [v.get("POSSUM_CUPTI") for v in overhead.MODE_ENV.values()])
        self.assertTrue(set(overhead.MODES[1:]) <= set(overhead.MODE_ENV))


class JobLostTime(unittest.TestCase):
    def test_a_slow_step_after_the_gap_is_the_wait_after_resume(self):
        import speculation
        step = 0.034
        # The gap, then a step that waited for buffers not back yet: both count.
        got = speculation.lost_time([step, step, 2.843, 0.451, step, 0.09], step)
        self.assertAlmostEqual(got, 2.843 + 0.451 - 2 * step)
        # The wait inside the gap: the gap alone.
        self.assertAlmostEqual(speculation.lost_time([step, 3.273, step], step), 3.273 - step)
        self.assertEqual(speculation.lost_time([], step), 0.0)

    def test_the_release_digest_keeps_where_the_final_copy_went(self):
        import services
        pipe = {"writers": 16, "staging_wait_ms": 1.0, "copy_wait_ms": 2.0, "sink_ms": 900.0}
        got = services.release_digest({"ms": 400.0, "final": [{"bytes": 8, "ms": 300.0, "pipeline": pipe,
                                                                "written": [{"dev": 1}], "sync_ms": 20.0,
                                                                "commit_ms": 4.0}]})
        self.assertEqual(got["finals"], [{"buffers": None, "bytes": 8, "ms": 300.0, "image_bytes": None,
                                          "pipeline": pipe, "shadows_saved_by_keeper": None,
                                          "sync_ms": 20.0, "commit_ms": 4.0}])
        self.assertIsNone(services.release_digest(None))

    def test_a_migration_trial_s_row_keeps_its_release(self):
        import ckpt
        final = {"bytes": 8, "ms": 250.0, "shadows_saved_by_keeper": 6, "written": [{"dev": 1}]}
        mg = {"rc": 0, "stderr": "", "json": {"timings": {"downtime_ms": 2800.0},
                                               "checkpoint": {"figures": {"hold_ms": 1800.0},
                                                              "release_report": {"ms": 500.0, "final": [final]}}}}
        ahead = {"prestage": 1, "reused_bytes": 5}
        pre = {"bytes": 9, "rewritten": 3, "ahead": ahead, "socket": "/k.sock"}
        restore = {"criu_restore_ms": 160.0, "driver_restore_ms": 270.0, "hostmem_fill_ms": 70.0,
                   "criu_restore_stats": {"forking_ms": 3.0}, "job_waited_ms": None}
        row = ckpt.migrate_row(mg, {"timings": {"restore_ms": 450.0}, "staged": [{"reused_bytes": 7}],
                                    "prestaged": [pre], "restore": restore})
        self.assertEqual(row["restore"], {"criu_restore_ms": 160.0, "driver_restore_ms": 270.0,
                                          "hostmem_fill_ms": 70.0})
        self.assertEqual((row["prestaged"][0]["rewritten"], row["prestaged"][0]["ahead"]), (3, ahead))
        self.assertNotIn("socket", row["prestaged"][0])
        self.assertEqual(row["release"]["finals"][0]["shadows_saved_by_keeper"], 6)
        self.assertEqual(row["release"]["ms"], 500.0)
        self.assertEqual((row["source"], row["received"]), ({"hold_ms": 1800.0}, {"restore_ms": 450.0}))
        self.assertEqual((row["staged_reused_bytes"], row["stderr"]), ([7], None))
        failed = ckpt.migrate_row({"rc": 2, "stderr": "why", "json": None}, None)
        self.assertEqual((failed["release"], failed["stderr"], failed["prestaged"]), (None, "why", []))
        self.assertIsNone(failed["restore"])


if __name__ == "__main__":
    unittest.main()
