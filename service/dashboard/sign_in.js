// The sign-in form: shown when the tab has no token or the service refused the one it had.

import { ApiError, api, session } from "./api.js";
import { el } from "./format.js";

export class SignInView {
  // onSignedIn({user, admin}) runs once the service accepted the token; `notice` explains why we are here.
  constructor(onSignedIn, notice = "") {
    this.onSignedIn = onSignedIn;
    this.notice = notice;
  }

  mount(root) {
    this.input = el("input", {
      type: "password", name: "token", id: "token", autocomplete: "off", spellcheck: "false",
      placeholder: "ty_…", required: true, "aria-describedby": "sign-in-help",
    });
    this.button = el("button", { type: "submit", class: "button primary" }, "Sign in");
    this.error = el("p", { class: "sign-in-error", role: "alert", hidden: !this.notice }, this.notice);
    const form = el("form", { class: "card sign-in", "aria-label": "sign in", onsubmit: (e) => this.submit(e) },
      el("h1", {}, "Sign in to torchyard"),
      el("label", { for: "token" }, "API token"),
      this.input,
      this.error,
      el("p", { class: "muted", id: "sign-in-help" },
        "Ask the operator of this service for a token. On the service host one is made with ",
        el("code", {}, "torchyard token create --user NAME"),
        ". It is kept in this tab only and forgotten when the tab closes."),
      el("div", { class: "actions" }, this.button));
    root.replaceChildren(form);
    document.title = "Sign in · torchyard";
    this.input.focus();
  }

  async submit(event) {
    event.preventDefault();
    const token = this.input.value.trim();
    if (!token) return this.fail("Paste your API token first.");
    this.button.disabled = true;
    try {
      const { data } = await api.whoami(token); // the token is kept only once the service accepts it
      session.save(token);
      this.onSignedIn(data);
    } catch (error) {
      const refused = error instanceof ApiError && error.status === 401;
      this.fail(refused ? `Sign-in failed: ${error.message}` : `Cannot sign in: ${error.message}`);
      this.input.select();
    } finally {
      this.button.disabled = false;
    }
  }

  fail(message) {
    this.error.textContent = message;
    this.error.hidden = false;
  }
}
