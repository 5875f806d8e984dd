"""Leader election of coordinator replicas on etcd (``pushkv coordinator --etcd``).

Every replica holds an etcd lease (TTL ``lease_s``) that it keeps alive, and
campaigns with one transaction: create the election key, bound to its lease and
holding its advertised address, if the key does not exist; otherwise read it.
The replica that created the key leads; the key's create revision is the
leader's *term* (it grows with every new leadership). The key goes away when
the leader's lease ends: revoked on a clean shutdown, expired in etcd when the
leader dies or loses etcd. Standbys repeat the transaction every ``poll_s``.

No split brain: the leader counts its lease as valid until the *send* time of
its last acknowledged keep-alive plus the TTL etcd granted, which is never
later than etcd's own expiry of the lease (etcd starts the TTL when it handles
the request, after we sent it). It stops ordering (``Leadership.may_order``
turns false, the watchdog steps it down) ``margin`` seconds before that time,
so before any standby can create the key. A leader that loses the leadership
never leads again in this process: ``on_lost`` ends it (its in-memory state
belongs to the old term), and its supervisor starts a fresh standby.

A leader's lease is renewed twice over: by the loop (with the check that the
key is still ours), and by a thread of its own (lease_keeper.py), so a loop
saturated by its streams, whose timers run late, keeps its lease; the thread
stops renewing once the loop has not run for ``--loop-stall-limit-s``, so a
wedged leader still hands over.

The etcd API is aetcd's (a maintained asyncio etcd v3 client on grpc.aio, see
docs/reliability.md): its generated stubs, called so that every call carries
its own deadline, over a grpc.aio channel of our own (`EtcdConn`): aetcd's
Client dials plain text only, and https:// endpoints need TLS (the CA, and a
client certificate where etcd demands one), and an etcd user's token on every
call where etcd's authentication is on. This module and lease_keeper.py (its
stubs on a synchronous channel) are the only ones that import aetcd, and only
``pushkv.controlplane.server`` imports this module, when ``--etcd`` is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from aetcd import rpc

from pushkv.controlplane.leadership import (
    ElectionSettings,
    Leadership,
    Role,
    View,
    endpoints,
    etcd_tls,
)
from pushkv.controlplane.lease_keeper import LeaseKeeper, LoopPulse

log = structlog.get_logger("pushkv.coordinator")


def _why(exc: BaseException) -> str:
    if isinstance(exc, rpc.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class LeaseLost(Exception):
    """etcd answered that the replica's lease no longer exists."""


def _refusal(exc: BaseException) -> str | None:
    """Why etcd refuses this replica for good (bad user or password, or no
    permission on the election key); None for anything worth retrying."""
    if not isinstance(exc, rpc.AioRpcError):
        return None
    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
        return f"etcd denies the user permission on the election key: {exc.details()}"
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in str(
        exc.details()
    ):
        return f"etcd refused the user or password: {exc.details()}"
    return None


def _token_expired(exc: BaseException) -> bool:
    """etcd no longer knows the auth token (unused past its --auth-token-ttl)."""
    return isinstance(exc, rpc.AioRpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED


def read_password(path: str) -> str:
    """The password in `path` (a mounted secret), without its trailing newline."""
    text = Path(path).read_text()
    return text[:-1] if text.endswith("\n") else text


def credentials(settings: ElectionSettings) -> grpc.ChannelCredentials | None:
    """TLS credentials for https:// endpoints (None for http://)."""
    if not etcd_tls(settings.etcd):
        return None
    ca = Path(settings.tls_ca).read_bytes()
    cert = Path(settings.tls_cert).read_bytes() if settings.tls_cert else None
    key = Path(settings.tls_key).read_bytes() if settings.tls_key else None
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


@dataclass
class EtcdConn:
    """One channel to one etcd member, the etcd services the election calls,
    and the metadata every call carries (the user's auth token, if any)."""

    channel: grpc.aio.Channel
    kvstub: Any
    leasestub: Any
    authstub: Any
    metadata: tuple[tuple[str, str], ...] = ()
    authenticated: bool = False  # a token taken (or etcd's auth found off)

    @classmethod
    def open(cls, host: str, port: int, creds: grpc.ChannelCredentials | None) -> EtcdConn:
        target = f"{host}:{port}"
        channel = (
            grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
        )
        return cls(channel, rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.AuthStub(channel))

    async def authenticate(self, user: str, password: str, deadline_s: float) -> bool:
        """Take a token for `user`: every later call carries it; False (no
        token) where etcd's authentication is off, as etcd's own Go client
        does. etcd refuses a bad user or password with INVALID_ARGUMENT (see
        `_refusal`)."""
        try:
            reply = await self.authstub.Authenticate(
                rpc.AuthenticateRequest(name=user, password=password), timeout=deadline_s
            )
        except rpc.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in str(
                exc.details()
            ):
                self.metadata, self.authenticated = (), True
                return False
            raise
        self.metadata, self.authenticated = (("token", reply.token),), True
        return True

    async def close(self) -> None:
        await self.channel.close(None)


class EtcdElection:
    """Campaigns until cancelled; drives `leadership`; calls `on_lost` once if
    this replica led and stopped leading."""

    def __init__(
        self,
        settings: ElectionSettings,
        leadership: Leadership,
        on_lost: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self._leadership = leadership
        self._on_lost = on_lost
        self._endpoints = endpoints(settings.etcd)
        self._next_endpoint = 0
        self._key = settings.key.encode()
        self._value = settings.advertise.encode()
        self._client: EtcdConn | None = None
        self._creds = credentials(settings)  # read once: a missing file fails at start
        self._password = read_password(settings.password_file) if settings.user else ""
        self.refused = ""  # why etcd refused this replica for good (it stops)
        self._lease_id = 0
        self._ttl = float(settings.lease_s)
        self._valid_until = 0.0  # monotonic: our lease is alive in etcd until at least this
        self._lost = False
        self._watchdog: asyncio.Task[None] | None = None
        # A leader's lease is also renewed from a thread (lease_keeper.py),
        # while the loop's pulse (a task, run while leading) is younger than
        # `settings.loop_stall_limit_s`.
        self._keeper: LeaseKeeper | None = None
        self._pulse_task: asyncio.Task[None] | None = None
        self._update(Role.STANDBY, "", 0)

    @property
    def lost(self) -> bool:
        """This replica led and leads no more (it never campaigns again)."""
        return self._lost

    # ------------------------------------------------------------ timing
    @property
    def margin_s(self) -> float:
        """How long before our lease could expire in etcd we stop ordering."""
        return self._ttl / 4

    def _call_timeout(self) -> float:
        return max(self._ttl / 4, 0.1)

    # ------------------------------------------------------------ state
    def _update(self, role: Role, leader: str, term: int) -> None:
        deadline = self._valid_until - self.margin_s if role is Role.LEADER else 0.0
        self._leadership.update(
            View(role, leader, term, self.settings.advertise, self.settings.etcd),
            order_deadline=deadline,
        )

    def _refuse(self, reason: str) -> None:
        """etcd refused our credentials or permissions: stop, saying why."""
        self.refused = reason
        log.error("etcd_refused", endpoint=self._endpoint, reason=reason)
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        """Stop leading, for good (the process ends: see on_lost)."""
        if self._lost:
            return
        self._lost = True
        self._stop_keeper()
        view = self._leadership.view
        self._update(Role.STANDBY, "", view.term)
        log.error("leadership_lost", term=view.term, reason=reason)
        self._on_lost(reason)

    # ------------------------------------------------------------ main loop
    async def run(self) -> None:
        backoff = 0.05
        try:
            while not self._lost:
                host, port = self._endpoints[self._next_endpoint % len(self._endpoints)]
                try:
                    await self._session(host, port)
                    backoff = 0.05
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except Exception as exc:
                    if self.lost:
                        return
                    refused = _refusal(exc)
                    if refused is not None:
                        self._refuse(refused)
                        return
                    log.warning(
                        "etcd_session_failed",
                        endpoint=f"{host}:{port}",
                        error=_why(exc),
                    )
                    self._next_endpoint += 1
                finally:
                    await self._close_client()
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 1.0)
        finally:
            self._stop_keeper()
            if self._watchdog is not None:
                self._watchdog.cancel()

    async def resign(self) -> None:
        """A clean shutdown: revoke the lease, so a standby leads at once."""
        if self._lost:
            return  # nothing to hand over: the lease is gone or about to expire
        # The connection is the resign's from here: the session, which ends as
        # it sees _lost, must not close it under the revoke (a closed channel
        # cancels its calls: the process would exit 1 instead of 0).
        client, self._client = self._client, None
        lease_id = self._lease_id
        self._stop_keeper()  # it would renew what is revoked next
        led = self._leadership.view.role is Role.LEADER
        if led:
            self._lost = True  # this process leads no more; on_lost is not called
            self._update(Role.STANDBY, "", self._leadership.view.term)
        if client is None:
            return
        try:
            if lease_id:
                with contextlib.suppress(Exception):
                    await client.leasestub.LeaseRevoke(
                        rpc.LeaseRevokeRequest(ID=lease_id),
                        timeout=self._call_timeout(),
                        metadata=client.metadata,
                    )
                    if led:
                        log.info("leadership_resigned", lease=lease_id)
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    @property
    def _conn(self) -> EtcdConn:
        """The open connection (the session's; it exists while one runs)."""
        assert self._client is not None, "no etcd session"
        return self._client

    @property
    def _endpoint(self) -> str:
        host, port = self._endpoints[self._next_endpoint % len(self._endpoints)]
        return f"{host}:{port}"

    async def _next_member(self) -> None:
        """Renew through the next etcd endpoint (a leader keeps its lease)."""
        await self._close_client()
        self._next_endpoint += 1
        host, port = self._endpoints[self._next_endpoint % len(self._endpoints)]
        # Not authenticated yet: that is a call to a member that may be down
        # too, made in _lead's loop, where a failure moves on to the next one.
        self._client = EtcdConn.open(host, port, self._creds)
        log.info("etcd_endpoint_switched", endpoint=self._endpoint, lease=self._lease_id)

    async def _connect(self, host: str, port: int) -> EtcdConn:
        """A connection to one member, authenticated where a user is set."""
        conn = EtcdConn.open(host, port, self._creds)
        if self.settings.user:
            try:
                if not await conn.authenticate(self.settings.user, self._password, 2.0):
                    log.warning(
                        "etcd_auth_not_enabled",
                        endpoint=f"{host}:{port}",
                        detail=f"--etcd-user {self.settings.user} given, but etcd's "
                        "authentication is off: calls go without a token",
                    )
            except BaseException:
                with contextlib.suppress(Exception):
                    await conn.close()
                raise
        return conn

    async def _renew_token(self) -> bool:
        """etcd forgot our auth token (its TTL passed, or etcd restarted): take
        a new one on the open connection. False if that failed too."""
        if not self.settings.user:
            return False
        try:
            await self._conn.authenticate(self.settings.user, self._password, self._call_timeout())
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.warning("etcd_token_renewal_failed", endpoint=self._endpoint, error=_why(exc))
            return False
        log.info("etcd_token_renewed", endpoint=self._endpoint)
        return True

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    async def _session(self, host: str, port: int) -> None:
        self._client = await self._connect(host, port)
        sent = time.monotonic()
        grant = await self._client.leasestub.LeaseGrant(
            rpc.LeaseGrantRequest(TTL=self.settings.lease_s),
            timeout=2.0,
            metadata=self._client.metadata,
        )
        if grant.error:
            raise RuntimeError(f"lease grant refused: {grant.error}")
        self._lease_id, self._ttl = grant.ID, float(grant.TTL)
        self._valid_until = sent + self._ttl
        log.info("etcd_lease_granted", endpoint=f"{host}:{port}", lease=grant.ID, ttl_s=grant.TTL)
        next_keepalive = time.monotonic() + self._ttl / 4
        while not self._lost:
            if self._leadership.view.role is not Role.LEADER:
                await self._campaign()
            if self._leadership.view.role is Role.LEADER:
                await self._lead()  # returns only when the leadership ended
                return
            if time.monotonic() >= next_keepalive:
                await self._keepalive()
                next_keepalive = time.monotonic() + self._ttl / 4
            await asyncio.sleep(self.settings.poll_s)

    async def _keepalive(self) -> None:
        sent = time.monotonic()
        reply = None
        async for r in self._conn.leasestub.LeaseKeepAlive(
            iter([rpc.LeaseKeepAliveRequest(ID=self._lease_id)]),
            timeout=self._call_timeout(),
            metadata=self._conn.metadata,
        ):
            reply = r
            break
        if reply is None or reply.TTL <= 0:
            raise LeaseLost(f"lease {self._lease_id} expired in etcd")
        self._renewed(sent + float(reply.TTL))

    async def _campaign(self) -> None:
        """One try at the key: lead if it was free, else learn who leads."""
        txn = rpc.TxnRequest(
            compare=[
                rpc.Compare(
                    result=rpc.Compare.EQUAL,
                    target=rpc.Compare.CREATE,
                    key=self._key,
                    create_revision=0,
                )
            ],
            success=[
                rpc.RequestOp(
                    request_put=rpc.PutRequest(
                        key=self._key, value=self._value, lease=self._lease_id
                    )
                )
            ],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=self._key))],
        )
        reply = await self._conn.kvstub.Txn(
            txn, timeout=self._call_timeout(), metadata=self._conn.metadata
        )
        if reply.succeeded:
            self._won(reply.header.revision)
            return
        kvs = reply.responses[0].response_range.kvs
        if not kvs:
            return  # deleted in between: try again at the next poll
        kv = kvs[0]
        if kv.lease == self._lease_id:  # ours (an answer lost on the way)
            self._won(kv.create_revision)
            return
        view = self._leadership.view
        leader, term = kv.value.decode(errors="replace"), kv.create_revision
        if (leader, term) != (view.leader, view.term):
            log.info("leader_observed", leader=leader, term=term)
        self._update(Role.STANDBY, leader, term)

    def _won(self, term: int) -> None:
        if time.monotonic() >= self._valid_until - self.margin_s:
            return  # too close to our lease's end to order anything: renew first
        self._update(Role.LEADER, self.settings.advertise, term)
        key = self.settings.key
        log.info("leadership_won", term=term, lease=self._lease_id, ttl_s=self._ttl, key=key)
        loop = asyncio.get_running_loop()
        self._watchdog = loop.create_task(self._watch_deadline())
        self._start_keeper(loop)

    # ------------------------------------------------------------ the keeper
    def _start_keeper(self, loop: asyncio.AbstractEventLoop) -> None:
        lease_id = self._lease_id

        def expired() -> None:  # on the keeper's thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: it ended
                loop.call_soon_threadsafe(self._lose, f"lease {lease_id} expired in etcd")

        self._stop_keeper()
        pulse = LoopPulse()
        self._pulse_task = loop.create_task(pulse.run())
        self._keeper = LeaseKeeper(
            lease_id,
            self._where,
            self._creds,
            pulse,
            interval_s=self._ttl / 4,
            call_timeout_s=self._call_timeout(),
            on_renewed=self._renewed,
            on_expired=expired,
            stall_limit_s=self.settings.loop_stall_limit_s,
        )
        self._keeper.start()

    def _stop_keeper(self) -> None:
        """On the loop: the keeper and its pulse end."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
        task, self._pulse_task = self._pulse_task, None
        if task is not None:
            task.cancel()

    def _where(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The current endpoint and auth metadata (read by the keeper's thread)."""
        client = self._client
        return self._endpoint, client.metadata if client is not None else ()

    def _renewed(self, valid_until: float) -> None:
        """A keep-alive acknowledged (from either renewer; plain float writes)."""
        self._valid_until = max(self._valid_until, valid_until)
        self._leadership.extend(valid_until - self.margin_s)

    async def _watch_deadline(self) -> None:
        """Step down when the lease could not be renewed in time."""
        while not self._lost:
            wait = self._valid_until - self.margin_s - time.monotonic()
            if wait <= 0:
                self._lose(f"etcd lease not renewed within {self._ttl - self.margin_s:.2f} s")
                return
            await asyncio.sleep(wait)

    async def _lead(self) -> None:
        """Renew the lease every TTL/4 and check the key is still ours."""
        term = self._leadership.view.term
        failures = 0
        while not self._lost:
            try:
                if self.settings.user and not self._conn.authenticated:  # after a switch
                    await self._conn.authenticate(
                        self.settings.user, self._password, self._call_timeout()
                    )
                await self._keepalive()
                if failures:
                    log.info("etcd_keepalive_recovered", endpoint=self._endpoint, failures=failures)
                    failures = 0
                reply = await self._conn.kvstub.Range(
                    rpc.RangeRequest(key=self._key),
                    timeout=self._call_timeout(),
                    metadata=self._conn.metadata,
                )
                kv = reply.kvs[0] if reply.kvs else None
                if kv is None or kv.lease != self._lease_id or kv.create_revision != term:
                    self._lose("the election key is no longer ours")
                    return
            except LeaseLost as exc:
                self._lose(str(exc))
                return
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as exc:  # transient: retry until the deadline
                if self.lost:  # resigned meanwhile: resign took the connection
                    return
                refused = _refusal(exc)
                if refused is not None:
                    self._refuse(refused)
                    return
                if _token_expired(exc) and await self._renew_token():
                    continue  # the same lease, within the same deadline
                failures += 1
                log.warning("etcd_keepalive_failed", endpoint=self._endpoint, error=_why(exc))
                if len(self._endpoints) > 1:
                    await self._next_member()  # the lease lives in the cluster, not the member
                else:
                    await asyncio.sleep(min(0.1, self._ttl / 20))
                continue
            await asyncio.sleep(self._ttl / 4)
