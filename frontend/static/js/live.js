// The run page's websocket (ws/runs/<id>/?since_step=N, docs/architecture.md §7): reconnects with
// exponential backoff and asks only for the steps it missed.

const PERMANENT = { 4400: "bad request", 4401: "you are signed out; reload the page to sign in", 4403: "not allowed", 4404: "no such run" };
const MAX_DELAY_S = 30;

export class RunSocket {
  // sinceStep(): the last step the page holds (null: none yet); onMessage(msg); onState(state, detail)
  constructor(runId, { sinceStep, onMessage, onState, maxPoints = 1000 }) {
    Object.assign(this, { runId, sinceStep, onMessage, onState, maxPoints });
    this.attempt = 0;
    this.stopped = false;
    this.socket = null;
    this.timer = null;
  }

  url() {
    const scheme = window.location.protocol === "https:" ? "wss" : "ws";
    const query = new URLSearchParams({ max_points: this.maxPoints });
    const since = this.sinceStep();
    if (since !== null && since !== undefined && Number.isFinite(since)) query.set("since_step", since);
    return `${scheme}://${window.location.host}/ws/runs/${this.runId}/?${query}`;
  }

  start() {
    if (this.stopped) return;
    clearInterval(this.timer);
    this.onState(this.attempt ? "reconnecting" : "connecting", {});
    let socket;
    try {
      socket = new WebSocket(this.url());
    } catch (err) {
      this.scheduleRetry();
      return;
    }
    this.socket = socket;
    socket.onopen = () => {
      this.attempt = 0;
      this.onState("live", {});
    };
    socket.onmessage = (event) => {
      let message;
      try {
        message = JSON.parse(event.data);
      } catch {
        return;
      }
      this.onMessage(message);
    };
    socket.onclose = (event) => {
      if (this.socket !== socket || this.stopped) return;
      this.socket = null;
      if (PERMANENT[event.code]) {
        this.stopped = true;
        this.onState("closed", { reason: event.reason || PERMANENT[event.code], code: event.code });
        return;
      }
      this.scheduleRetry();
    };
  }

  scheduleRetry() {
    this.attempt += 1;
    const base = Math.min(MAX_DELAY_S, 2 ** (this.attempt - 1));
    let left = Math.max(1, Math.round(base * (0.8 + Math.random() * 0.4))); // jitter: clients do not return in step
    this.onState("reconnecting", { seconds: left });
    clearInterval(this.timer);
    this.timer = setInterval(() => {
      left -= 1;
      if (left <= 0) this.start();
      else this.onState("reconnecting", { seconds: left });
    }, 1000);
  }

  retryNow() {
    this.attempt = Math.max(this.attempt, 1);
    this.start();
  }

  stop() {
    this.stopped = true;
    clearInterval(this.timer);
    if (this.socket) this.socket.close(1000);
    this.socket = null;
  }
}
