//! The `mpipemoe` command-line tool, run as a user runs it.

#[test]
fn plan_json_equals_eq_1_to_9_by_hand_for_two_presets() {
    for (preset, m, h) in [("gpt3-s", 768.0, 3072.0), ("bert-l", 1024.0, 4096.0)] {
        let (b, e, n_gpus, n) = (8192.0, 64.0, 8.0, 4.0);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mpipemoe"))
            .args([
                "plan",
                "--preset",
                preset,
                "--tokens",
                "8192",
                "--gpus",
                "8",
                "--partitions",
                "4",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let paper = &json["paper"];
        let local = e / n_gpus;
        let m_ms = 4.0 * (e * m + 2.0 * h * m * local);
        let m_act = 4.0 * b * m + b * h;
        let m_buf = b * m + b * h;
        let delta = b * (2.0 * m * (n - 2.0) / n + h * (n - 1.0) / n);
        let phi = 2.0 * delta / (m_ms + 2.0 * m_act);
        for (key, want) in [
            ("m_ms", m_ms),
            ("m_act", m_act),
            ("m_buf", m_buf),
            ("m_act_pipe", m_act),
            ("delta_m_act", delta),
            ("delta_m_buf", delta),
            ("phi", phi),
        ] {
            let got = paper[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{preset}: no paper.{key}"));
            assert!(
                (got - want).abs() <= 1e-9 * want.abs(),
                "{preset} {key}: {got} vs {want}"
            );
            assert!(
                json["implementation"][key].is_number(),
                "{preset}: no implementation.{key}"
            );
        }
    }
}
