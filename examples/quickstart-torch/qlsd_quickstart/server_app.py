"""The ServerApp: QLSD++ over the clients; the server knows only d, the prior and the settings."""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from qlsd_flwr.flower import QLSDStrategy
from qlsd_flwr.potentials import TorchPotential
from qlsd_quickstart.task import PRIOR_VAR, held_out_data, make_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    c = context.run_config
    model = make_model()
    X_test, y_test = held_out_data()  # the verdict reads the predictive on them, not the weights
    strategy = QLSDStrategy(
        num_clients=c["num-clients"], dim=sum(p.numel() for p in model.parameters()),
        variant="qlsd-pp", gamma=c["gamma"], num_rounds=c["num-rounds"], burn_in=c["burn-in"],
        s=c["s"], prior_var=PRIOR_VAR, seed=c["seed"], output_dir=c["output-dir"] or "outputs",
        run_name=c["run-name"], heldout=(TorchPotential(model, X_test, y_test), X_test, y_test),
        checkpoint_every=c["checkpoint-every"], resume=c["resume"])
    # on a resume the checkpoint's θ is taken and initial_arrays ignored, so one app serves both
    strategy.start(grid, initial_arrays=ArrayRecord(model.state_dict()))
