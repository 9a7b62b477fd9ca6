"""The clients' side of an untrusted-server run: what must never be in the server's process.

Under a mode whose server is untrusted (``sample``, ``distributed``, ``dprivacy``) the coordinator
actor is the server. What a round produces that is the clients' alone: their persistent state (a
personal model, PINA's base update and hidden slot), their secure-aggregation inputs (each a clipped
vector without noise), and under ``sample`` the training itself (the raw gradients before DP-SGD's
noise: the coordinator trains no clients), and their scores in an evaluation (each client's test
loss and accuracy). ``ClientSide`` is one actor that keeps the states, the inputs and the scores,
standing for the clients' devices, the secure-aggregation protocol they submit to, and the
experimenter who reads their scores:

* the workers have a piece's clients admitted to the request and get their states before
  running it, and hand back the new states and the contributions after (``admit``, ``keep``),
  presenting the run's client key; ``admit`` is the devices' memory of what they trained and
  were evaluated on, which keeps a server from having a round run twice on other inputs
  (``modes.device``); after an evaluation they hand back the scores (``keep_evaluations``),
  and reply to the server with none;
* the server may only ask for the noisy per-slot sums of the members it names
  (``secure_sums``: their noise drawn here, from the clients' seed), and for a new worker in
  place of a lost one (``new_worker``: the worker is built here, with the key and the clients'
  seed, so neither passes through the server);
* the driver (the experimenter, not the server) has each evaluation judged here, against the
  truth (``judge``: the round's metrics, and the early stop, for its rows; ``evaluations``:
  the latest scores, for the per-client results), and saves and restores the states and the
  judge with each checkpoint (``snapshot``, ``restore``), with the key. This side outlives a
  lost server, as devices would, with its memory of what the clients released; the driver
  then has it end the workers it started for that server (``end_workers``).

The key (``client_key``) is drawn from the OS, not from the run's seed: it decides no result
(it only gates who may read), and a key the server could derive from the seed would gate
nothing. For the same reason the clients draw their noise from the clients' seed
(``privacy.client_seed``, raysim.seeding), not from the run's, which the server holds. Nothing
of the server's process holds either: the driver gives them to this actor and to the workers it
starts.

States are kept per round written, so a snapshot asked for after round r returns the states as
they were after round r even when round r + 1's workers have already handed back new ones (the
driver asks for the snapshot while the next round runs).

Without Ray (``raysim compare --inline``) the same ``ClientSide`` and one worker live in a child
process (``ClientsProcess``), which the server's process drives through a pipe.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any

from raysim.engine.driver import Snapshot, read_snapshot
from raysim.metrics.evaluation import Judge
from raysim.protocol import EvalReport, SecureContribution, SecureSums


def client_key() -> bytes:
    return secrets.token_bytes(16)


class ClientSide:
    def __init__(
        self,
        key: bytes,
        worker_options: dict[str, Any],
        worker_args: tuple,
        snapshots: bool,
        client_seed: int,
        secure: dict[str, Any] | None = None,
        judge: Judge | None = None,
    ) -> None:
        """``snapshots``: the driver will ask for snapshots (checkpoints are on); without them
        only each client's newest state is kept. ``client_seed``: the clients' seed (the secure
        sums' noise is drawn from it). ``secure``: the calibrated secure sum (the fields of
        ``modes.secure.SecureSpec``, from the run's privacy summary; None: the run releases
        none), given by the driver. ``judge``: the experimenter's reading of the clients'
        evaluations (with the truth), given by the driver."""
        self._key = key
        self._seed = client_seed
        self._secure = secure
        # round -> the members its sum was released over: a round is summed again (after a
        # restart, from the same inputs) only over the same members, which gives the same bits
        self._summed: dict[int, tuple[int, ...]] = {}
        self._worker = (worker_options, worker_args)
        self._started: list[Any] = []  # the workers started here (new_worker)
        self._snapshots = snapshots
        # client -> [(round written, state)], oldest first; the first entry is the newest one
        # at or before the last snapshot (what a restore of that snapshot would need)
        self._states: dict[int, list[tuple[int, Any]]] = {}
        self._snapshot_round = 0
        self._deposits: dict[int, dict[int, SecureContribution]] = {}  # round -> client -> input
        # kind -> client -> round -> what decided its output: the devices' memory (modes.device)
        self._served: dict[str, dict[int, dict[int, bytes]]] = {}
        self._judge = judge
        self._evaluations: dict[int, dict[int, EvalReport]] = {}  # round -> client -> score
        self._judged: dict[int, dict[str, Any]] = {}  # round -> its metrics, as judged

    def _check(self, key: bytes) -> None:
        if not hmac.compare_digest(key, self._key):
            raise PermissionError("the clients' state is read only with the run's client key")

    # -- the workers -------------------------------------------------------------------------
    def admit(
        self,
        key: bytes,
        kind: str,
        round: int,
        requests: dict[int, bytes],
        limit: int | None = None,
    ) -> tuple[dict[int, Any], list[int]]:
        """The states the clients run ``kind`` from in ``round`` (to train it: the newest
        written before it; to evaluate after it, the newest), once each is admitted, and the
        clients admitted to it for the first time. What decides a client's output (its request,
        ``modes.device.request_digest``, with its state) is recorded: a client trains a round,
        and is evaluated after it, once, or again from the same request and state, which gives
        the same bits (``modes.device``: two releases of a round on other inputs would cancel
        its noise); of two pieces of a client's round at once, the second is refused.
        ``limit``: the most rounds a client may train in (its mode's cap)."""
        from raysim.privacy.modes.device import (  # torch: not in the driver
            ReleaseRefused,
            state_digest,
        )

        self._check(key)
        before = round if kind == "train" else round + 1
        states = {c: self._state_before(c, before) for c in requests}
        served = {c: state_digest(d, states[c]) for c, d in requests.items()}
        memory = self._served.setdefault(kind, {})
        again = [c for c, d in served.items() if memory.get(c, {}).get(round, d) != d]
        if again:
            raise ReleaseRefused(
                f"round {round}: clients {sorted(again)[:10]} were asked to {kind} it again on "
                "other inputs; a client does so once"
            )
        new = [c for c in served if round not in memory.get(c, {})]
        over = [c for c in new if limit is not None and len(memory.get(c, {})) >= limit]
        if over:
            why = f"they trained the {limit} rounds their leakage cap allows"
            raise ReleaseRefused(f"round {round}: clients {sorted(over)[:10]}: {why}")
        for c, d in served.items():
            memory.setdefault(c, {})[round] = d
        return {c: s for c, s in states.items() if s is not None}, new

    def withdraw(self, key: bytes, kind: str, round: int, clients: list[int]) -> None:
        """Forget the admission of clients whose piece released nothing because what the
        server sent was refused: the round is still theirs."""
        self._check(key)
        memory = self._served.get(kind, {})
        for c in clients:
            memory.get(c, {}).pop(round, None)

    def _state_before(self, client: int, round: int) -> Any:
        versions = [s for r, s in self._states.get(client, []) if r < round]
        return versions[-1] if versions else None

    def keep(
        self,
        key: bytes,
        round: int,
        states: dict[int, Any],
        contributions: dict[int, SecureContribution],
    ) -> None:
        """A piece's new states and secure inputs. A piece run again (its worker died) hands
        back the same values, which replace the first ones."""
        self._check(key)
        for c, state in states.items():
            versions = [v for v in self._states.get(c, []) if v[0] < round]
            kept = self._since_snapshot(versions) if self._snapshots else []
            self._states[c] = [*kept, (round, state)]
        if contributions:
            self._deposits.setdefault(round, {}).update(contributions)

    def keep_evaluations(self, key: bytes, round: int, reports: list[EvalReport]) -> None:
        """A piece's scores after ``round``: the experimenter's, never the server's (a piece
        run again hands back the same ones)."""
        self._check(key)
        self._evaluations.setdefault(round, {}).update({r.client_id: r for r in reports})

    def _since_snapshot(self, versions: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """The versions a restore may still need: those after the last snapshot, and the newest
        one at or before it."""
        before = [v for v in versions if v[0] <= self._snapshot_round]
        return before[-1:] + [v for v in versions if v[0] > self._snapshot_round]

    # -- the server ------------------------------------------------------------------------------
    def secure_sums(self, round: int, members: list[int], aggregator: Any) -> SecureSums:
        """The round's noisy per-slot sums over ``members`` (in client-id order, as the
        in-process aggregator adds them); the inputs are dropped once summed. Of the server's
        ``aggregator`` only the shape is taken (slots, dimension): the clip and the noise are
        this side's own (``SecureSpec``), and a round is summed over one member set, within the
        planned number of sums, so the server can neither lower the noise (under adaptive
        clipping the server's clip is taken, the noise scaled to it) nor difference two
        sums (the noise of a round is drawn from the same stream each time: two member sets
        would give the inputs of the clients in one and not the other). A round run again after
        a restart is summed again over the same members, which gives the same bits."""
        from raysim.privacy.modes.secure import (  # torch: not in the driver
            SecureSpec,
            secure_noise_rng,
        )

        if self._secure is None:
            raise PermissionError("this run releases no secure sum")
        spec = SecureSpec(**self._secure)
        over = tuple(sorted(members))
        earlier = self._summed.get(round)
        if earlier not in (None, over) or (earlier is None and len(self._summed) >= spec.releases):
            why = (
                "summed already, over other members"
                if earlier is not None
                else f"past the {spec.releases} planned"
            )
            raise PermissionError(f"round {round}: no secure sum ({why})")
        deposits = self._deposits.pop(round, {})
        for r in [r for r in self._deposits if r < round]:  # a failed attempt's leftovers
            del self._deposits[r]
        missing = sorted(set(members) - set(deposits))
        if missing:
            raise RuntimeError(f"round {round}: no secure input from clients {missing[:10]}")
        rng = secure_noise_rng(self._seed, round)
        agg = spec.aggregator(
            aggregator.num_slots, aggregator.dim, aggregator.algorithm, aggregator.clip
        )
        sums = agg.aggregate([deposits[c] for c in over], rng)
        self._summed[round] = over
        return sums

    def new_worker(self, index: int) -> Any:
        import ray

        from raysim.runtime.worker import ClientWorker

        options, args = self._worker
        me = ray.get_runtime_context().current_actor
        side = (OnRay(me), self._key)
        worker = ray.remote(ClientWorker).options(**options).remote(*args, client_side=side)
        self._started.append(worker)
        return worker

    def end_workers(self, key: bytes) -> None:
        """End the workers started here for a server that was lost (this side outlives it)."""
        import ray

        self._check(key)
        for worker in self._started:
            ray.kill(worker)
        self._started = []

    # -- the driver ------------------------------------------------------------------------------
    def judge(self, key: bytes, round: int) -> dict[str, Any]:
        """The metrics of the evaluation after ``round`` (``Judge``), once all its pieces ran:
        the driver adds them to the round's row. Every client to judge is scored (each
        algorithm's evaluation plan has them all: every client, or the run's evaluation cohort):
        metrics over fewer, or others, would be over clients the server chose."""
        self._check(key)
        if self._judge is None:
            raise PermissionError("this clients' side was given no judge")
        scores = self._evaluations.pop(round, {})
        for r in [r for r in self._evaluations if r < round]:  # a failed attempt's leftovers
            del self._evaluations[r]
        unjudged = self._judge.unjudged(list(scores))
        if unjudged:
            raise RuntimeError(
                f"round {round}: the evaluation's clients are not the ones to judge (clients "
                f"{unjudged[:10]} missing or not to be judged)"
            )
        self._judged[round] = self._judge(list(scores.values()))
        return self._judged[round]

    def evaluations(self, key: bytes) -> list[EvalReport]:
        """The latest evaluation's scores, for the per-client results (``clients.parquet``)."""
        self._check(key)
        return [] if self._judge is None else self._judge.last

    def snapshot(self, key: bytes, round: int) -> bytes:
        """The clients' states as they were after ``round``, and what they released up to it
        (what they trained and were evaluated on, the rounds summed and over whom)."""
        self._check(key)
        self._snapshot_round = max(self._snapshot_round, round)
        out = {}
        for c, versions in self._states.items():
            done = [v for v in versions if v[0] <= round]
            if done:
                out[c] = done[-1][1]
            self._states[c] = self._since_snapshot(versions)
        served = {
            kind: {c: {r: d for r, d in rs.items() if r <= round} for c, rs in memory.items()}
            for kind, memory in self._served.items()
        }
        summed = {r: m for r, m in self._summed.items() if r <= round}
        judged = {r: row for r, row in self._judged.items() if r <= round}
        snap = {"states": out, "served": served, "summed": summed}
        snap |= {"judge": self._judge, "judged": judged}  # the driver judged up to ``round``
        from raysim.state.checkpoint import encode_state

        return encode_state(snap)

    def restore(self, key: bytes, blob: bytes | None, round: int) -> dict[int, dict[str, Any]]:
        """Back to the states of a snapshot after ``round`` (None: a run from round 1). What the
        clients released is not forgotten, the snapshot's nor this side's own: the rounds after
        it run again from the same requests, and are summed over the same members (a snapshot
        written before the clients kept it holds the states alone). The judge goes back to the
        snapshot's too (a snapshot written before the clients judged: to none, and the rows
        already hold their metrics); returns the metrics judged up to ``round``, by round, for
        the driver's rows."""
        self._check(key)
        snap = read_snapshot(blob) if blob is not None else Snapshot({}, {}, {})
        for kind, memory in snap.served.items():
            mine = self._served.setdefault(kind, {})
            for c, rounds in memory.items():
                mine[c] = {**rounds, **mine.get(c, {})}
        self._summed = {**snap.summed, **self._summed}
        self._states = {c: [(round, s)] for c, s in snap.states.items()}
        self._snapshot_round = round
        self._deposits.clear()
        if self._judge is not None:
            fresh = Judge(self._judge.truth, self._judge.patience, cohort=self._judge.cohort)
            self._judge = snap.judge or fresh
        self._evaluations.clear()
        self._judged = dict(snap.judged)
        return dict(snap.judged)


class OnRay:
    """A ``ClientSide`` actor as a worker calls it: each call waits for its answer."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def admit(self, key: bytes, kind: str, round: int, requests: dict, limit: int | None) -> tuple:
        import ray

        return ray.get(self.actor.admit.remote(key, kind, round, requests, limit))

    def withdraw(self, key: bytes, kind: str, round: int, clients: list[int]) -> None:
        import ray

        ray.get(self.actor.withdraw.remote(key, kind, round, clients))

    def keep(self, key: bytes, round: int, states: dict, contributions: dict) -> None:
        import ray

        ray.get(self.actor.keep.remote(key, round, states, contributions))

    def keep_evaluations(self, key: bytes, round: int, reports: list) -> None:
        import ray

        ray.get(self.actor.keep_evaluations.remote(key, round, reports))


# ------------------------------------------------------------------ one run without Ray


class ClientsProcess:
    """The clients' side of a run without Ray (``raysim compare --inline``, the GPU box): a
    child process holds the data, the worker and a ``ClientSide``; this process, the server's,
    sends it the round's tasks and gets the reports (without states, contributions or scores),
    the secure sums, the judged evaluations and the clients' snapshots. Spawned, not forked: a
    fork would copy this process's heap, and a forked torch is unsafe with OpenMP threads
    running."""

    def __init__(
        self,
        worker_args: tuple,
        snapshots: bool,
        client_seed: int,
        secure: dict[str, Any] | None = None,
        judge: Judge | None = None,
    ) -> None:
        import multiprocessing

        self.key = client_key()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, self.key, worker_args, snapshots, client_seed, secure, judge)
        self._process = ctx.Process(target=_serve_clients, args=args, daemon=True)
        self._process.start()
        child.close()
        self.device = self._call("device")

    def _call(self, op: str, *args: Any) -> Any:
        self._conn.send((op, args))
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def run(self, kind: str, round: int, models: Any, groups: list) -> list[Any]:
        return self._call("run", kind, round, models, groups)

    def secure_sums(self, round: int, members: list[int], aggregator: Any) -> Any:
        return self._call("secure_sums", round, members, aggregator)

    def snapshot(self, round: int) -> bytes:
        return self._call("snapshot", round)

    def restore(self, blob: bytes | None, round: int) -> dict[int, dict[str, Any]]:
        return self._call("restore", blob, round)

    def judge(self, round: int) -> dict[str, Any]:
        return self._call("judge", round)

    def evaluations(self) -> list[EvalReport]:
        return self._call("evaluations")

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("stop", ()))
            self._process.join(timeout=30)
        self._conn.close()


def _serve_clients(
    conn: Any,
    key: bytes,
    worker_args: tuple,
    snapshots: bool,
    client_seed: int,
    secure: dict[str, Any] | None,
    judge: Judge | None,
) -> None:
    import signal

    # Ctrl-C reaches the whole process group: the server's process handles it (marks its run
    # interrupted) and closes this one, which must not print a traceback of its own; first,
    # before the imports below, which take seconds and which a Ctrl-C would interrupt
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from raysim.runtime.worker import ClientWorker

    side = ClientSide(key, {}, (), snapshots, client_seed, secure, judge)
    worker = ClientWorker(*worker_args, client_side=(side, key))
    ops = {
        "device": lambda: str(worker.device),
        "run": worker.run,
        "secure_sums": side.secure_sums,
        "snapshot": lambda round: side.snapshot(key, round),
        "restore": lambda blob, round: side.restore(key, blob, round),
        "judge": lambda round: side.judge(key, round),
        "evaluations": lambda: side.evaluations(key),
    }
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # the server's process is gone
            return
        if op == "stop":
            return
        try:
            reply = (True, ops[op](*args))
        except Exception as exc:  # the server's process raises it
            reply = (False, exc)
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError):  # the server's process stopped (Ctrl-C,
            return  # `kill`) while this one worked: nothing is waiting for the reply
