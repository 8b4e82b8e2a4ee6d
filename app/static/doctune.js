// DocTune: the little JavaScript the pages need on top of htmx.
// A drop zone for files, an upload progress bar, and a plain message when the server
// cannot be reached. Everything still works (less smoothly) without it.
(function () {
  "use strict";
  document.documentElement.classList.add("js");

  function zoneOf(event) {
    return event.target instanceof Element ? event.target.closest("[data-dropzone]") : null;
  }

  function send(form) {
    if (form.requestSubmit) form.requestSubmit(); else form.submit();
  }

  document.addEventListener("dragover", function (event) {
    var zone = zoneOf(event);
    event.preventDefault(); // a file dropped next to the zone must not replace the page
    if (zone) {
      event.dataTransfer.dropEffect = "copy";
      zone.classList.add("dragging");
    } else {
      event.dataTransfer.dropEffect = "none";
    }
  });

  document.addEventListener("dragleave", function (event) {
    var zone = zoneOf(event);
    if (zone && !zone.contains(event.relatedTarget)) zone.classList.remove("dragging");
  });

  document.addEventListener("drop", function (event) {
    event.preventDefault();
    var zone = zoneOf(event);
    if (!zone || !event.dataTransfer || !event.dataTransfer.files.length) return;
    zone.classList.remove("dragging");
    var input = zone.querySelector("input[type=file]");
    input.files = event.dataTransfer.files;
    send(input.form);
  });

  document.addEventListener("change", function (event) {
    var input = event.target;
    if (input.matches && input.matches("[data-dropzone] input[type=file]") && input.files.length) {
      send(input.form);
    }
  });

  // Upload progress: htmx relays the XHR's upload progress events.
  document.addEventListener("htmx:xhr:progress", function (event) {
    var form = event.target.closest && event.target.closest("form");
    var bar = form && form.querySelector(".upload-progress");
    if (!bar || !event.detail.lengthComputable) return;
    bar.hidden = false;
    bar.value = Math.round((event.detail.loaded / event.detail.total) * 100);
    bar.textContent = bar.value + "%";
  });

  document.addEventListener("htmx:afterRequest", function (event) {
    var form = event.target;
    if (form && form.id === "upload-form") {
      var bar = form.querySelector(".upload-progress");
      if (bar) bar.hidden = true;
      form.reset(); // the same file can be chosen again
    }
  });

  function notice(text) {
    var slot = document.getElementById("notice");
    if (!slot) return;
    slot.innerHTML = "";
    var box = document.createElement("div");
    box.className = "notice notice-error";
    box.setAttribute("role", "alert");
    box.textContent = text;
    slot.appendChild(box);
  }

  document.addEventListener("htmx:sendError", function () {
    notice("DocTune is not answering. Is it still running? Reload this page once it is.");
  });

  document.addEventListener("htmx:responseError", function () {
    notice("DocTune hit an unexpected problem. Reload the page and try again.");
  });

  document.addEventListener("htmx:afterOnLoad", function (event) {
    var xhr = event.detail.xhr;
    var slot = document.getElementById("notice");
    if (slot && xhr && xhr.status < 500) slot.innerHTML = "";
  });
})();

// Copy buttons: <button data-copy="#id-of-element-with-the-text">. The clipboard API needs a
// secure page (localhost is one); elsewhere the text is selected and copied the old way.
(function () {
  "use strict";
  function selectText(el) {
    var range = document.createRange();
    range.selectNodeContents(el);
    var sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
  }
  function copied(button, ok) {
    var label = button.textContent;
    button.textContent = ok ? "Copied" : "Press Ctrl+C to copy";
    setTimeout(function () { button.textContent = label; }, 1500);
  }
  document.addEventListener("click", function (event) {
    var button = event.target.closest && event.target.closest("[data-copy]");
    if (!button) return;
    var source = document.querySelector(button.getAttribute("data-copy"));
    if (!source) return;
    var text = source.textContent;
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(
        function () { copied(button, true); },
        function () { selectText(source); copied(button, false); });
    } else {
      selectText(source);
      var ok = false;
      try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
      copied(button, ok);
    }
  });
})();

// Chat: a reply that is still being written (<div data-reply-stream=URL data-reply-url=URL>)
// follows its Server-Sent Events: "status" lines, "token" pieces appended as plain text
// (textContent: the model's text never becomes markup here), then "done"/"error", when the
// finished reply (its Markdown rendered by the server) replaces the live one.
(function () {
  "use strict";
  function finish(box) {
    if (window.htmx) {
      window.htmx.ajax("GET", box.getAttribute("data-reply-url"), { target: box, swap: "outerHTML" })
        .then(function () { var q = document.getElementById("question"); if (q) q.focus(); });
    }
  }
  function follow(box) {
    if (box.dataset.following) return;
    box.dataset.following = "1";
    var text = box.querySelector(".reply-live");
    var status = box.querySelector(".msg-status-text");
    var source = new EventSource(box.getAttribute("data-reply-stream"));
    function data(event) { try { return JSON.parse(event.data); } catch (e) { return {}; } }
    source.addEventListener("status", function (event) { status.textContent = data(event).text || ""; });
    source.addEventListener("token", function (event) {
      status.textContent = "Writing…";
      text.textContent += data(event).text || "";
    });
    function end() { source.close(); finish(box); }
    source.addEventListener("done", end);
    source.addEventListener("error", function (event) {
      if (event.data !== undefined) { end(); return; } // the reply failed: the server says why
      if (source.readyState === EventSource.CLOSED) finish(box); // the connection is gone
    });
  }
  function scan(root) {
    var boxes = (root || document).querySelectorAll("[data-reply-stream]");
    for (var i = 0; i < boxes.length; i++) follow(boxes[i]);
  }
  document.addEventListener("DOMContentLoaded", function () { scan(document); });
  document.addEventListener("htmx:load", function (event) { scan(event.target.parentNode || document); });
  document.addEventListener("htmx:afterRequest", function (event) {
    var form = event.target;
    if (form && form.id === "ask-form" && event.detail.successful) form.reset();
  });
})();
