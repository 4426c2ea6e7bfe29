"""The search figures' importances: the parameter that drives the score, ties in the CSV ordered by name."""


def test_search_importance_names_the_parameter_that_drives_the_score(tmp_path):
    import numpy as np
    import optuna

    from selfspec.eval.figures import dimension_of, param_importances, write_figures

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    noise = np.random.default_rng(0).normal(size=80)  # mlp_5 and threshold do not move the score

    def score(t):
        t.suggest_int("mlp_5", 0, 1), t.suggest_float("threshold", 0.0, 1.0)
        return 3.0 * t.suggest_int("attn_3", 0, 1) + noise[t.number]

    study.optimize(score, n_trials=80)
    imp = param_importances(study.trials)
    assert max(imp, key=imp.get) == "attn_3" and imp["attn_3"] > 0.5
    assert (dimension_of("attn_3"), dimension_of("mlp_12"), dimension_of("k")) == ("attention skips", "MLP skips", "k")
    studies = tmp_path / "optuna"
    studies.mkdir()
    optuna.copy_study(from_study_name=study.study_name, from_storage=storage,
                      to_storage=f"sqlite:///{studies / 's.db'}", to_study_name="s")
    written = write_figures({}, studies, tmp_path / "figures")
    assert tmp_path / "figures" / "search_importance.png" in written
    rows = (tmp_path / "figures" / "search_importance.csv").read_text().splitlines()
    assert rows[0] == "study,parameter,dimension,importance" and rows[1].startswith("s,attn_3,attention skips,")


def test_searchimportance_csv_orders_ties_by_name(tmp_path):
    from selfspec.eval.figures import importance_csv

    path = importance_csv({"s": {"mlp_4": 0.03081, "attn_1": 0.030799, "k": 0.5, "attn_0": 0.001}}, tmp_path / "i.csv")
    assert [r.split(",")[1] for r in path.read_text().splitlines()[1:]] == ["k", "attn_1", "mlp_4", "attn_0"]
