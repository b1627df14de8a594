// Swagger UI on /docs (service/api/routes/dashboard.py serves the page). A file, not an inline script:
// the page's Content-Security-Policy runs the service's own files only. Nothing is fetched from
// elsewhere: no validator badge (validatorUrl), the schema from this origin.
"use strict";

const root = document.getElementById("swagger-ui");
window.ui = SwaggerUIBundle({
  url: root.dataset.openapi,
  domNode: root,
  layout: "BaseLayout",
  presets: [SwaggerUIBundle.presets.apis],
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  validatorUrl: null,
});
