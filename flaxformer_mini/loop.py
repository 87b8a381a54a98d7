"""The training loop around the pure step: progress, checkpoints, signals, guards.

The loop keeps each step's metrics on the device and fetches them every
`log_every` steps, so the host never waits for the device between two logs,
and the next batches are made in threads (data/prefetch.py) while the device
runs.
It saves a checkpoint every `checkpoint_every` steps, at every evaluation and
at the end; stops within --max_train_minutes, checked at every log and at
least every few seconds; turns SIGINT / SIGTERM into a last checkpoint and a
clean exit; and never saves a state that is not finite: the losses since the
last fetch and the state itself are checked before every save.
"""

import contextlib
import signal
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from flaxformer_mini import logbook
from flaxformer_mini.checkpoints import Checkpoints
from flaxformer_mini.config import TransformerConfig
from flaxformer_mini.data.prefetch import prefetched
from flaxformer_mini.masks import Batch
from flaxformer_mini.parallel import DataParallel
from flaxformer_mini.training import TrainState

_SUMMED = ('loss_sum', 'ntokens', 'correct')

# evaluate(state) -> (score, higher is better; stop training now?)
Evaluate = Callable[[TrainState], tuple[float, bool]]


class Interrupted(Exception):
  """SIGINT or SIGTERM arrived; the last step's checkpoint is on disk."""

  def __init__(self, signum: int, when: str, checkpoint: str | None):
    self.signum, self.checkpoint = signum, checkpoint
    where = (f'checkpoint saved at {checkpoint}; run the same command again '
             'to resume' if checkpoint else 'no checkpoint was saved')
    super().__init__(f'interrupted by {signal.Signals(signum).name} {when}: '
                     f'{where}.')


class NonFinite(Exception):
  """The loss or the training state became NaN or infinite."""

  def __init__(self, what: str, step: int, last_good: int | None):
    self.step = step
    kept = (f'the latest checkpoint, step {last_good}, is the last good one'
            if last_good is not None else 'no checkpoint was written')
    super().__init__(
        f'{what} at step {step}; training stopped and {kept}. Lower '
        '--lr_factor, raise --warmup_steps, or use float32.')


class SignalCatcher:
  """SIGINT / SIGTERM during a run (main thread only).

  Inside `deferred()` (the training loop) a signal is only recorded, so the
  current step ends and a checkpoint is saved; anywhere else it raises
  Interrupted at once (`when` says where the run was).
  """

  def __init__(self):
    self.received: int | None = None
    self.when = 'before training started'
    self.checkpoint: str | None = None
    self._deferring = False
    self._previous = {}

  def __enter__(self):
    try:
      for signum in (signal.SIGINT, signal.SIGTERM):
        self._previous[signum] = signal.signal(signum, self._handle)
    except ValueError:  # not the main thread: leave the handlers alone
      pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signum
    if not self._deferring:
      raise Interrupted(signum, self.when, self.checkpoint)

  @contextlib.contextmanager
  def deferred(self):
    self._deferring = True
    try:
      yield self
    finally:
      self._deferring = False

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)


@jax.jit
def _all_finite(tree) -> jax.Array:
  """True where every floating-point leaf of `tree` is finite: -> bool[]."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


# The time budget is checked at every log and, between logs, at least this
# often: each check waits for the device to finish the steps dispatched, so
# that the clock measures work done, not work queued.
BUDGET_CHECK_SECONDS = 2.0


class _OnDevice:
  """The state on the devices, and what the loop knows of it.

  Each step's metrics stay on the device until a log, a save or an
  evaluation fetches them, so the host never waits for the device between
  two of those; every fetched loss is checked, and a state is checked before
  it is saved or evaluated.
  """

  def __init__(self, config: TransformerConfig, state: TrainState, rng,
               parallel: DataParallel, checkpoints: Checkpoints | None):
    self.config, self.rng = config, rng
    self.parallel, self.checkpoints = parallel, checkpoints
    self.state = parallel.replicate(state)
    self.done = int(state.step)  # steps taken (dispatched)
    self.last_saved = checkpoints.latest_step() if checkpoints else None
    self._unfetched = []  # metrics of the latest steps, on the device
    self._window = []     # fetched metrics since the last log, on the host

  def take(self, batch: Batch) -> None:
    """Dispatches one training step (the device may still be running it)."""
    self.state, metrics = self.parallel.train_step(
        self.state, self.parallel.put_batch(batch), self.rng)
    self._unfetched.append(metrics)
    self.done += 1

  def check_losses(self) -> None:
    """Fetches the metrics not yet fetched; NonFinite at a non-finite loss."""
    first = self.done - len(self._unfetched) + 1
    for offset, metrics in enumerate(self._unfetched):
      metrics = self.parallel.to_host(metrics)
      if not np.isfinite(metrics['loss_sum']):
        raise NonFinite(f'the loss became {float(metrics["loss_sum"])}',
                        first + offset, self.last_saved)
      self._window.append(metrics)
    self._unfetched = []

  def check_state(self) -> None:
    """NonFinite unless every loss so far and the state itself are finite."""
    self.check_losses()
    if not bool(self.parallel.to_host(_all_finite(self.state))):
      raise NonFinite('the parameters or optimizer state became non-finite',
                      self.done, self.last_saved)

  def window(self) -> list[dict]:
    """The metrics of every step since the last call, on the host."""
    self.check_losses()
    window, self._window = self._window, []
    return window

  def wait(self) -> None:
    """Returns once the device has finished every step dispatched."""
    jax.block_until_ready(self._unfetched[-1:])

  def save(self, score: float | None = None) -> None:
    """Saves the state (never a non-finite one), unless this step is saved."""
    if self.checkpoints is not None and self.last_saved != self.done:
      self.check_state()
      self.checkpoints.save(self.done, self.state, self.rng, self.config,
                            score)
      self.last_saved = self.done


class _Budget:
  """--max_train_minutes: stop at the last check the budget reaches.

  Each check judges the next interval by the one just finished (steps and
  any evaluation): training stops when it would pass the budget.
  """

  def __init__(self, minutes: float, started: float):
    self.minutes = minutes
    self.deadline = minutes * 60 or float('inf')
    self.started = self.last_check = started

  def due(self, now: float) -> bool:
    """Whether a check is due between logs."""
    return (self.deadline < float('inf') and
            now - self.last_check >= BUDGET_CHECK_SECONDS)

  def ends_before_next(self, now: float) -> bool:
    """Checks at `now`, once the device has caught up: stop now?"""
    ends = now - self.started + (now - self.last_check) > self.deadline
    self.last_check = now
    return ends

  def stops(self, on_device: '_OnDevice', logged: bool) -> bool:
    """At a log, or where a check is due: waits for the device; stop now?"""
    if not (logged or self.due(time.perf_counter())):
      return False
    on_device.wait()
    if not self.ends_before_next(time.perf_counter()):
      return False
    tqdm.tqdm.write(f'--max_train_minutes={self.minutes}: stopping after '
                    f'step {on_device.done}, before the next steps would '
                    'pass it')
    return True


class _Logger:
  """Each log: the window's record into the history, the logbook and the
  progress bar."""

  def __init__(self, config: TransformerConfig, log: logbook.Logbook | None,
               progress: tqdm.tqdm, first_step: int, started: float):
    self.config, self.log, self.progress = config, log, progress
    self.first_step, self.started = first_step, started
    self.window_start = started
    self.history = []

  def write(self, on_device: '_OnDevice') -> None:
    now = time.perf_counter()
    record = _log_record(on_device.window(), now - self.window_start,
                         (now - self.started) / 60, on_device.done)
    self.history.append(record)
    if self.log is not None:
      self.log.write('train', record)
    if len(self.history) == 1:
      _warn_if_the_budget_is_short(self.config,
                                   on_device.done - self.first_step,
                                   now - self.started)
    self.progress.set_postfix(loss=f"{record['loss']:.4f}",
                              lr=f"{record['learning_rate']:.2e}",
                              tok_s=f"{record['target_tokens_per_s']:.0f}")
    self.progress.update(on_device.done - self.progress.n)
    self.window_start = time.perf_counter()


def _log_record(window: list[dict], seconds: float, minutes: float,
                step: int) -> dict:
  """The record of one log: the window's per-token loss and accuracy, the
  last learning rate, target tokens/s over `seconds`, minutes since the start."""
  sums = {k: sum(m[k] for m in window) for k in _SUMMED}
  tokens = max(sums['ntokens'], 1)
  return {'step': step,
          'loss': float(sums['loss_sum'] / tokens),
          'accuracy': float(sums['correct'] / tokens),
          'learning_rate': float(window[-1]['learning_rate']),
          'target_tokens_per_s': float(sums['ntokens'] / seconds),
          'minutes': minutes}


def train(config: TransformerConfig, state: TrainState, rng,
          batch_at: Callable[[int], Batch], evaluate: Evaluate | None = None,
          parallel: DataParallel | None = None,
          checkpoints: Checkpoints | None = None,
          log: logbook.Logbook | None = None,
          signals: SignalCatcher | None = None,
          timings: dict | None = None):
  """Runs the data-parallel train_step from state.step to config.train_steps.

  The batches are made ahead in threads (`prefetched`) while the device runs.

  Args:
    config: the run's config.
    state: the initial TrainState (one ordinary copy).
    rng: the base dropout key (see train_step).
    batch_at: step -> this process's rows of the Batch of that step.
    evaluate: called every `eval_every` steps with one ordinary copy of the
      state; its score is saved with the checkpoint, and it may stop training.
    parallel: how the step is mapped over the devices (default: every device).
    checkpoints: where to save every `checkpoint_every` steps and at the end.
    log: where each logged record goes as well (metrics.jsonl, TensorBoard).
    signals: the run's SignalCatcher (default: one for this loop alone).
    timings: where given, gets 'first_step': the time.perf_counter() at which
      the first step was dispatched (compiled, running).

  Returns:
    (final state, history): one dict per log with step, loss, accuracy,
    learning_rate and target tokens/s.

  Raises:
    Interrupted: after SIGINT / SIGTERM, once the checkpoint is written.
    NonFinite: at the first non-finite loss, or when the state to be saved
      (or the final one) is not finite.
  """
  parallel = parallel or DataParallel(config)
  on_device = _OnDevice(config, state, rng, parallel, checkpoints)
  started = time.perf_counter()
  budget = _Budget(config.max_train_minutes, started)
  with contextlib.ExitStack() as stack:
    if signals is None:
      signals = stack.enter_context(SignalCatcher())
    # One bar, on process 0; left to tqdm's default there, so that
    # TQDM_DISABLE=1 in the environment turns it off.
    quiet = {'disable': True} if jax.process_index() > 0 else {}
    logger = _Logger(config, log, stack.enter_context(tqdm.tqdm(
        total=config.train_steps, initial=on_device.done, unit='step',
        dynamic_ncols=True, **quiet)),
                     on_device.done, started)
    stack.enter_context(signals.deferred())
    if checkpoints is not None:  # before the signals stop being deferred
      stack.callback(checkpoints.wait)
    batches = prefetched(batch_at, on_device.done, config.train_steps)
    stack.callback(batches.close)
    for _ in range(on_device.done, config.train_steps):
      on_device.take(next(batches))
      if timings is not None:
        timings.setdefault('first_step', time.perf_counter())
      logged = (on_device.done % config.log_every == 0 or
                on_device.done == config.train_steps)
      if logged:
        logger.write(on_device)
      score, stop = None, False
      if evaluate is not None and on_device.done % config.eval_every == 0:
        on_device.check_state()  # evaluate (and save) only a finite state
        score, stop = evaluate(parallel.local_copy(on_device.state))
      stop = budget.stops(on_device, logged) or stop
      every = config.checkpoint_every
      if ((every and on_device.done % every == 0) or score is not None or
          stop or signals.received is not None):
        on_device.save(score)
      if signals.received is not None:
        raise Interrupted(signals.received, f'after step {on_device.done}',
                          checkpoints and
                          checkpoints.step_path(on_device.done))
      if stop:
        break
    on_device.save()
    on_device.check_state()  # also where nothing is saved: never end non-finite
  if checkpoints is not None and on_device.last_saved is not None:
    signals.checkpoint = checkpoints.step_path(on_device.last_saved)
  signals.when = f'after training, at step {on_device.done}'
  return parallel.local_copy(on_device.state), logger.history


def _warn_if_the_budget_is_short(config: TransformerConfig, steps: int,
                                 seconds: float) -> None:
  """Says at the first log when --max_train_minutes ends the run too early:
  before its saves, or before its learning rate cools down."""
  if not config.max_train_minutes or not steps:
    return
  reach = int(steps / seconds * config.max_train_minutes * 60)
  if reach >= config.train_steps:
    return  # the steps end the run first
  every = config.checkpoint_every
  if every and reach < every:
    before = (f'the first checkpoint (--checkpoint_every={every}); the run '
              'saves only when it stops')
  elif every and config.average_last > 1 and reach < every * config.average_last:
    before = (f'{config.average_last} checkpoints to average '
              f'(--average_last, every {every} steps)')
  elif config.cooldown_steps:
    before = ('the learning rate has cooled down to 0 (--cooldown_steps='
              f'{config.cooldown_steps} ends at --train_steps='
              f'{config.train_steps}); lower --train_steps to fit')
  else:
    return
  tqdm.tqdm.write(f'--max_train_minutes={config.max_train_minutes} reaches '
                  f'about step {reach} at this speed, before {before}')
