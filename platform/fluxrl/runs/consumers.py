"""Websocket ws/runs/<id>/?since_step=N&max_points=M: on connect a run's status, its
metric history after step N (each series downsampled to M points) and recent samples;
then every change as it is pushed to the group run-<id> (live.py; the history on connect:
fluxrl.metrics.live.snapshot).

Close codes: 4400 bad query, 4401 not signed in, 4403 a token that may not read runs (a
run token, or no read scope), 4404 no run of the user's teams: a missing run and another
team's run get the same code and reason (live.run_for_subscriber), so the socket tells
nothing about which run ids exist. The same check is made again every FLUXRL_WS_RECHECK_S
on an open socket: a member removed from the team is closed with 4404, a user deactivated
or a token revoked after connecting with 4401."""
import asyncio

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user_model
from django.http import QueryDict

from fluxrl.errors import DomainError, Unauthorized, field_error
from fluxrl.metrics.live import snapshot

from . import live


def query_options(scope) -> tuple[int | None, int]:
    query = QueryDict(scope.get("query_string", b""))
    try:
        since_step = int(query["since_step"]) if query.get("since_step") else None
    except ValueError:
        raise field_error("since_step", "a whole number") from None
    try:
        max_points = int(query.get("max_points") or 1000)
    except ValueError:
        raise field_error("max_points", "a whole number") from None
    return since_step, max_points


def may_still_follow(user, token, run_id: int) -> None:
    """live.run_for_subscriber over what the database says now: the user and token are
    read again (deactivated, revoked or expired since connecting: 401), then membership."""
    if token is not None:
        token = type(token).objects.filter(pk=token.pk).first()
        if token is None or not token.is_active:
            raise Unauthorized("The token this socket signed in with has been revoked or has expired.")
    if user is not None and user.is_authenticated:
        user = get_user_model().objects.filter(pk=user.pk, is_active=True).first()
        if user is None:
            raise Unauthorized("This user has been deactivated.")
    live.run_for_subscriber(user, token, run_id)


def status_key(message: dict) -> tuple:
    return message["status"], message["cancel_requested"], message["failure_reason"]


class RunConsumer(AsyncJsonWebsocketConsumer):
    group = None
    poller = None
    rechecker = None
    last_status = None

    async def connect(self):
        await self.accept()  # first, so that a refusal reaches the client as a close code
        run_id = self.scope["url_route"]["kwargs"]["run_id"]
        try:
            since_step, max_points = query_options(self.scope)
            run = await database_sync_to_async(live.run_for_subscriber)(self.scope.get("user"), self.scope.get("auth"), run_id)
            # Join before reading the history: a batch stored in between then arrives
            # twice (subscribers key points by key and step) instead of not at all.
            self.group = live.group_name(run.pk)
            await self.channel_layer.group_add(self.group, self.channel_name)
            messages = await database_sync_to_async(snapshot)(run, since_step, max_points)
        except DomainError as exc:
            await self.close(code=4000 + exc.status, reason=exc.message[:120])
            return
        for message in messages:
            await self.send_json(message)
        self.last_status = status_key(messages[0])
        if settings.FLUXRL_WS_STATUS_POLL_S > 0:
            self.poller = asyncio.create_task(self.poll_status(run.pk))
        if settings.FLUXRL_WS_RECHECK_S > 0:
            self.rechecker = asyncio.create_task(self.recheck(run.pk))

    async def disconnect(self, code):
        for task in (self.poller, self.rechecker):
            if task and task is not asyncio.current_task():
                task.cancel()
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def dispatch(self, message):
        # Pushes touch no database: skip the close_old_connections() that channels runs
        # in a thread before every handler. With 200 sockets on a run that was 200
        # thread hops per push, through one thread, and pushes fell behind.
        if message["type"] == "run.event":
            await self.run_event(message)
        else:
            await super().dispatch(message)

    async def run_event(self, event):
        if event["message"]["type"] == "status":
            self.last_status = status_key(event["message"])
        # channels-redis hands one event object to all of a process' subscribers: encode
        # it once for them all (with 200 sockets on a run, encoding per socket was the
        # server's main cost and live pushes fell minutes behind).
        if "text" not in event:
            event["text"] = await self.encode_json(live.client_message(event["message"]))
        await self.send(text_data=event["text"])

    async def poll_status(self, run_id: int):
        # Status changes made where this server's channel layer does not reach (the
        # embedded in-memory layer: transitions made by the Celery worker) still
        # arrive, a few seconds late.
        while True:
            await asyncio.sleep(settings.FLUXRL_WS_STATUS_POLL_S)
            message = await database_sync_to_async(live.current_status)(run_id)
            if message and status_key(message) != self.last_status:
                await self.run_event({"message": message})

    async def recheck(self, run_id: int):
        # Membership is checked at connect; pushes touch no database (dispatch above), so
        # a removed member is found here, one query per socket every FLUXRL_WS_RECHECK_S.
        while True:
            await asyncio.sleep(settings.FLUXRL_WS_RECHECK_S)
            try:
                await database_sync_to_async(may_still_follow)(self.scope.get("user"), self.scope.get("auth"), run_id)
            except DomainError as exc:
                if self.group:
                    await self.channel_layer.group_discard(self.group, self.channel_name)
                    self.group = None
                await self.close(code=4000 + exc.status, reason=exc.message[:120])
                return
