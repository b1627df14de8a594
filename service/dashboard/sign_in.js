// The sign-in forms: shown when the tab has no token or the service refused the one it had. A user
// name and password (checked by the site's LDAP, when the service has one) or a pasted API token:
// either way the tab keeps a token, and only once the service accepted it.

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
    this.root = root;
    this.offerPassword(form);
  }

  // The user name and password form, above the token's, when the service signs in with LDAP.
  async offerPassword(tokenForm) {
    let methods;
    try {
      ({ data: methods } = await api.signInMethods());
    } catch {
      return; // the token form works without it
    }
    if (!methods.ldap || !tokenForm.isConnected) return;
    this.user = el("input", {
      type: "text", name: "user", id: "user", autocomplete: "username", spellcheck: "false",
      autocapitalize: "off", required: true,
    });
    this.password = el("input", {
      type: "password", name: "password", id: "password", autocomplete: "current-password", required: true,
    });
    this.passwordButton = el("button", { type: "submit", class: "button primary" }, "Sign in");
    this.passwordError = el("p", { class: "password-sign-in-error", role: "alert", hidden: true });
    const form = el("form", {
      class: "card sign-in-card password-sign-in", "aria-label": "sign in with a password",
      onsubmit: (e) => this.submitPassword(e),
    },
      el("h1", {}, "Sign in to torchyard"),
      el("label", { for: "user" }, "User name"),
      this.user,
      el("label", { for: "password" }, "Password"),
      this.password,
      this.passwordError,
      el("p", { class: "muted" }, "Your site account. The tab keeps a token that expires, and forgets it when it closes."),
      el("div", { class: "actions" }, this.passwordButton));
    this.root.insertBefore(form, tokenForm);
    tokenForm.querySelector("h1").textContent = "Or use an API token";
    if (document.activeElement === this.input && !this.input.value) this.user.focus();
  }

  async submitPassword(event) {
    event.preventDefault();
    const user = this.user.value.trim();
    const password = this.password.value;
    if (!user || !password) return this.failPassword("Enter your user name and password.");
    this.passwordButton.disabled = true;
    try {
      const { data: login } = await api.ldapSignIn(user, password);
      const { data } = await api.whoami(login.token);
      session.save(login.token); // kept as a pasted token is: in this tab only
      this.onSignedIn(data);
    } catch (error) {
      const refused = error instanceof ApiError && [401, 403, 422, 429].includes(error.status);
      this.failPassword(refused ? `Sign-in failed: ${error.message}` : `Cannot sign in: ${error.message}`);
      this.password.select();
    } finally {
      this.passwordButton.disabled = false;
    }
  }

  failPassword(message) {
    this.passwordError.textContent = message;
    this.passwordError.hidden = false;
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
