"""Where the phase probe wraps the frameworks' own methods: (module, class or "" for the module
itself, attribute) tables, each with what its calls are in a step and why (``phases.PhaseProbe``
patches a class only if its module was imported before the slice)."""

from __future__ import annotations

#: Where checkpoints are written, besides ``torch.save``: (module, class or "" for the module
#: itself, attribute). Each is a ``save`` span, the nested ones inside it part of it; a class is
#: patched only if its module was imported before the slice.
SAVERS: tuple[tuple[str, str, str], ...] = (
    ("transformers.trainer", "Trainer", "_save_checkpoint"),
    ("lightning.pytorch.trainer.trainer", "Trainer", "save_checkpoint"),
    ("pytorch_lightning.trainer.trainer", "Trainer", "save_checkpoint"),
    ("accelerate.accelerator", "Accelerator", "save_state"),
    ("accelerate.accelerator", "Accelerator", "save_model"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "save_checkpoint"),
    ("safetensors.torch", "", "save_file"),
    ("safetensors.torch", "", "save_model"),
    # torch.distributed.checkpoint, as a loop calls it (``dcp.save``, ``dcp.async_save``): only the
    # torch.save calls inside had been save, its planning, metadata and fsync other (~50 of ~100 ms
    # a save), and async_save's whole blocking part other (OVERHEAD-BOUND 35%). An async save's
    # writes in its own thread are not the loop's; its wait on the future is other, as any wait.
    ("torch.distributed.checkpoint", "", "save"),
    ("torch.distributed.checkpoint", "", "async_save"),
    # ... and the parts both look up in their module at each call, for a loop that bound them by
    # ``from torch.distributed.checkpoint import save`` before the slice (the package's names are
    # patched, not the loop's): the state dict's gathering, the save itself, async_save's staging
    # (dcp's logging around the call, and async_save's upload thread's start, stay other there)
    ("torch.distributed.checkpoint.state_dict_saver", "", "_stateful_to_state_dict"),
    ("torch.distributed.checkpoint.state_dict_saver", "", "_save_state_dict"),
    ("torch.distributed.checkpoint.staging", "DefaultStager", "stage"),
    # Keras 3 writes through h5py / a zip file, never torch.save (its ModelCheckpoint calls these):
    # a save each epoch had read other, save_s 0 (OVERHEAD-BOUND, "Python between phases")
    ("keras.src.models.model", "Model", "save"),
    ("keras.src.models.model", "Model", "save_weights"),
    # a model logged to MLflow as a checkpoint (``mlflow.pytorch.log_model`` every few steps): only
    # its inner torch.save had been save (3-27 ms of a 289-796 ms call), the rest (the model's
    # pickling, its environment files, the run's artifact store) other, and a loop logging its
    # model read OVERHEAD-BOUND. log_model calls save_model inside (part of its span). Where
    # ``mlflow.pytorch`` was imported before the slice. (``mlflow.log_artifact`` is left out: it
    # copies any file, a plot or a config as well as a checkpoint torch.save wrote already.)
    ("mlflow.pytorch", "", "log_model"),
    ("mlflow.pytorch", "", "save_model"),
    ("mlflow.pytorch", "", "log_state_dict"),
    ("mlflow.pytorch", "", "save_state_dict"),
)

#: Files read whole, as ``SAVERS`` (besides ``torch.load``): ``schema.FILE_LOAD`` spans, in other.
FILE_LOADERS: tuple[tuple[str, str, str], ...] = (
    ("safetensors.torch", "", "load_file"),
    ("safetensors.torch", "", "load_model"),
)

#: Weight averaging after the optimizer's step, as ``SAVERS``: ``optimizer`` time, the update's
#: (an EMA or SWA copy of the weights updated each step had been ``other``, and a loop averaging
#: every step read OVERHEAD-BOUND 45%, "Python between phases"). Inside a step's post hook it is
#: the optimizer's already.
#: The modules need not be imported before the slice: one imported inside it (a training function that
#: imports its EMA class) is patched at the end of the step it was imported in (``PhaseProbe._patch_late``).
AVERAGERS: tuple[tuple[str, str, str], ...] = (
    ("torch.optim.swa_utils", "AveragedModel", "update_parameters"),
    # the other libraries' EMA copies, updated by the loop after each step: diffusers' EMAModel.step
    # had read other (0.115 s of other's 0.133 s in a 0.244 s slice: OVERHEAD-BOUND 54%, "log and
    # compute metrics less often"), and timm's ModelEma* update alike
    ("diffusers.training_utils", "EMAModel", "step"),
    ("timm.utils.model_ema", "ModelEma", "update"),
    ("timm.utils.model_ema", "ModelEmaV2", "update"),
    ("timm.utils.model_ema", "ModelEmaV3", "update"),
    # gradient clipping, part of the update: the gradients' norm over every parameter (it had
    # been other, "Python between phases"; inside Lightning's closure it still was, and a
    # Trainer's clipping with it). Called by these names by HF's Trainer, accelerate, Lightning.
    ("torch.nn.utils", "", "clip_grad_norm_"),
    ("torch.nn.utils", "", "clip_grad_value_"),
    # and its two halves, read from their module at each call: a loop that bound
    # clip_grad_norm_ by name before the slice (from torch.nn.utils import ...) calls them too
    ("torch.nn.utils.clip_grad", "", "_get_total_norm"),
    ("torch.nn.utils.clip_grad", "", "_clip_grads_with_norm_"),
    # timm's adaptive gradient clipping (clip_mode="agc"), as clip_grad_norm_: its own module's, the
    # name timm's dispatch_clip_grad (its scalers, train.py) looks up in its module at each call, and
    # the package's (its time had been other: other 0.915 s in a loop whose clip clock read 0.776 s)
    ("timm.utils.agc", "", "adaptive_clip_grad"),
    ("timm.utils.clip_grad", "", "adaptive_clip_grad"),
    ("timm.utils", "", "adaptive_clip_grad"),
    # Lightning's call of the module's configure_gradient_clipping hook, whole (in its closure,
    # after backward): an override's own work had been other (81 of 233 ms read optimizer)
    ("lightning.pytorch.plugins.precision.precision", "Precision", "_clip_gradients"),
    ("pytorch_lightning.plugins.precision.precision", "Precision", "_clip_gradients"),
)

#: Optimizers that are no ``torch.optim.Optimizer``, as ``SAVERS``: their ``step`` runs none of
#: torch's step hooks, so the phase probe runs its own around it, as torch.optim's step does
#: (``PhaseProbe._wrap_foreign_step``): it ends the loop's steps, is ``optimizer`` time, and its
#: state (``opt.state``, keyed by parameter, and ``param_groups``, which fastai builds from its
#: ``param_lists`` and ``hypers``) is the memory probe's ``optimizer_state``. fastai's own (a
#: ``Learner``'s default ``opt_func=Adam``): a fit had recorded no step at all (0 of 16, "NO
#: STEPS"), and with ``tp.step()`` optimizer 0 s of 1.2 s, its 2,121,744 B of state other.
OPTIMIZER_STEPS: tuple[tuple[str, str, str], ...] = (
    ("fastai.optimizer", "Optimizer", "step"),
)
#: ... and their ``zero_grad``, which zeroes the gradients in place: ``optimizer`` time.
OPTIMIZER_ZERO_GRADS: tuple[tuple[str, str, str], ...] = (
    ("fastai.optimizer", "Optimizer", "zero_grad"),
)

#: Lightning's training step, where the LightningModule was compiled whole
#: (``trainer.fit(torch.compile(module))``): Lightning compiles its ``training_step``, the model's
#: calls inside run as compiled code and no module call is seen; the step's call is the forward
#: then (it had read forward 0 and its time other, with a note blaming a functional model).
COMPILED_STEPS: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.strategies.strategy", "Strategy", "training_step"),
    ("pytorch_lightning.strategies.strategy", "Strategy", "training_step"),
)

#: DataLoader subclasses that replace what the probe wraps on torch's, as ``SAVERS`` (patched
#: only if the loop imported them): torchdata's ``StatefulDataLoader.__iter__`` never calls
#: ``DataLoader.__iter__`` (its workers start there each epoch), and its multiprocessing iterator
#: has a ``_shutdown_workers`` of its own. Without them a 2-worker StatefulDataLoader's start-up
#: read other: data_wait 304 ms of 687 over a slice, other 388 ms.
LOADER_STARTS: tuple[tuple[str, str, str], ...] = (
    ("torchdata.stateful_dataloader.stateful_dataloader", "StatefulDataLoader", "__iter__"),
)
LOADER_SHUTDOWNS: tuple[tuple[str, str, str], ...] = (
    ("torchdata.stateful_dataloader.stateful_dataloader", "_StatefulMultiProcessingDataLoaderIter",
     "_shutdown_workers"),
)

#: A trainer's run (``train()``, ``fit()``): when it ends the next run is looked for anew, its
#: optimizer ending the steps (a sweep's next Trainer made its own, whose steps ended none: 10 of
#: 13 steps were missing), and a run the slice stopped through its switch takes the probes out
#: (a second ``train()`` in the same cell was ended by StopSlice after one step, silently).
TRAINER_RUNS: tuple[tuple[str, str, str], ...] = (
    ("transformers.trainer", "Trainer", "train"),
    # run again inside one train() by auto_find_batch_size at a smaller batch after an
    # out-of-memory error: the failed attempt's steps were the retry's (no word), its failed
    # batch the next step's samples (15 for 7) and its loss a "skipped update"
    ("transformers.trainer", "Trainer", "_inner_training_loop"),
    ("lightning.pytorch.trainer.trainer", "Trainer", "fit"),
    ("pytorch_lightning.trainer.trainer", "Trainer", "fit"),
)

#: A trainer's search that runs training steps of its own before the real ones (Lightning's
#: learning-rate and batch-size finders, ``Tuner`` or their callbacks): the loop runs unprofiled
#: meanwhile. Counted, its steps were the slice's (at a rising learning rate) and tpkit's stop
#: ended the search after them: Lightning read a diverging loss, suggested no rate and the
#: ``fit`` after it trained at another one.
SEARCHES: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.callbacks.lr_finder", "LearningRateFinder", "lr_find"),
    ("pytorch_lightning.callbacks.lr_finder", "LearningRateFinder", "lr_find"),
    ("lightning.pytorch.callbacks.batch_size_finder", "BatchSizeFinder", "scale_batch_size"),
    ("pytorch_lightning.callbacks.batch_size_finder", "BatchSizeFinder", "scale_batch_size"),
)

#: Lightning's launcher of the processes that train (``strategy="ddp_spawn"``, ``"ddp_fork"`` and
#: ``"ddp_notebook"``; Fabric's alike): tpkit profiles only its own process, so the probes are
#: paused while it runs. Forked workers had inherited the live probes: each recorded the slice's
#: steps and stopped its fit there (global_step 7 of 40), and their runs were never kept; the
#: parent's run read 0 steps with the advice to call tp.step().
LAUNCHERS: tuple[tuple[str, str, str], ...] = (
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher", "launch"),
    ("pytorch_lightning.strategies.launchers.multiprocessing", "_MultiProcessingLauncher", "launch"),
    ("lightning.fabric.strategies.launchers.multiprocessing", "_MultiProcessingLauncher", "launch"),
    ("lightning_fabric.strategies.launchers.multiprocessing", "_MultiProcessingLauncher", "launch"),
)

#: Where a trainer evaluates, as ``SAVERS``: each call is an ``eval`` span, whole (metrics,
#: gathering predictions, a Seq2Seq ``generate()``), and the batches read inside it are not
#: the step's (capture/evaluation.py).
EVALUATORS: tuple[tuple[str, str, str], ...] = (
    ("transformers.trainer", "Trainer", "evaluate"),
    ("lightning.pytorch.loops.evaluation_loop", "_EvaluationLoop", "run"),
    ("pytorch_lightning.loops.evaluation_loop", "_EvaluationLoop", "run"),
)

#: TorchScript's tracing, as ``SAVERS``: each call is a ``schema.JIT_TRACE`` span (other), and the
#: model's calls inside it go straight to torch, neither forward nor evaluation. TensorBoard's
#: ``add_graph`` (tensorboardX's, Lightning's ``TensorBoardLogger(log_graph=True)``) calls
#: ``torch.jit.trace`` in eval mode: its calls had read as an evaluation (eval_s 0.3-8.6 ms of a
#: 72 ms add_graph, the rest other, "evaluation ran inside the slice: 2 call(s)"). Both modules'
#: names: torch.jit's as callers spell them, torch.jit._trace's as ``trace`` calls
#: ``trace_module`` (a nested trace is part of the outer one).
TRACERS: tuple[tuple[str, str, str], ...] = (
    ("torch.jit", "", "trace"),
    ("torch.jit", "", "trace_module"),
    ("torch.jit", "", "_get_trace_graph"),  # torch.onnx.export's TorchScript path
    ("torch.jit._trace", "", "trace"),
    ("torch.jit._trace", "", "trace_module"),
    ("torch.jit._trace", "", "_get_trace_graph"),
)

#: Calls that are a trainer's evaluation only where a test says so (module, class, attribute, the
#: test's name in capture/frameworks.py ``EVALUATING``), then as ``EVALUATORS``: the evaluation
#: ends where the framework's call returns, and what the loop does after it (a logging handler, a
#: tracker upload) is the step's other. Bounded only by the evaluation's calls, that work had been
#: the evaluation's tail (capture/evaluation.py ``_tails``): an ignite handler logging 40 ms after
#: ``evaluator.run`` read eval 0.393 s for evaluator.run's 0.229 s, and the verdict EVAL-BOUND.
EVALUATORS_WHEN: tuple[tuple[str, str, str, str], ...] = (
    # pytorch-ignite: an Engine run from inside another Engine's run (a handler's evaluator.run)
    ("ignite.engine.engine", "Engine", "run", "ignite_inner_run"),
    # skorch: its fit loop's pass over the validation data (run_single_epoch(training=False))
    ("skorch.net", "NeuralNet", "run_single_epoch", "skorch_validation"),
    # ... and its scoring of that data at the epoch's end (valid_acc: an EpochScoring with on_train False)
    ("skorch.callbacks.scoring", "EpochScoring", "on_epoch_end", "skorch_validation_scoring"),
)


#: diffusers' pipelines (module, class): a subclass's own ``__call__`` samples (images every few
#: updates in diffusers' train_unconditional.py, the UNet left in train mode under the pipeline's
#: no_grad). Each call is an ``eval`` span, as ``EVALUATORS``' are: its denoising calls had been
#: training's forward (3.8 s for 1.7 s of training and 2.1 s of sampling by the loop's clocks).
#: Nothing in tpkit's own numbers tells them from an RL rollout's policy calls, which are training
#: (capture/sampling.py). Patched where the loop imported diffusers, in the subclasses imported
#: before the slice and those made inside it (``PhaseProbe._patch_pipelines``).
DIFFUSION_PIPELINE = ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline")


def subclasses(base: type) -> list[type]:
    """Every subclass of ``base`` made so far, at any depth."""
    out: list[type] = []
    todo: list[type] = [base]
    seen: set[type] = {base}
    while todo:
        subs: list[type] = todo.pop().__subclasses__()
        for sub in subs:
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                out.append(sub)
    return out
