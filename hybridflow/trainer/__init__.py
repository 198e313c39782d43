"""Everything that runs a training run: the RL and SFT loops (loop/), a run's life from
preflight to export (lifecycle/), what a config costs before any model loads (plan/), and
what a run reports (observe/). The models they train live in ``hybridflow.learners``."""
