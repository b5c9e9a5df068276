// Counts the loaded gallery images (references and thumbnails, not the plot previews) into
// data attributes (read by the browser tests; lazy images below the fold count once scrolled
// into view) and makes the "go to page" box navigate to a relative page name, which works
// under file:// and on S3 alike. Inlined into every page.
(function () {
  var body = document.body, imgs = Array.prototype.slice.call(document.querySelectorAll("main img"));
  function update() {
    var ok = 0, bad = 0;
    imgs.forEach(function (im) { if (im.complete) { if (im.naturalWidth > 0) ok++; else bad++; } });
    body.dataset.imagesTotal = imgs.length;
    body.dataset.imagesLoaded = ok;
    body.dataset.imagesFailed = bad;
    if (ok === imgs.length) body.dataset.allImagesLoaded = "true";
  }
  imgs.forEach(function (im) { im.addEventListener("load", update); im.addEventListener("error", update); });
  update();
  Array.prototype.forEach.call(document.querySelectorAll("form.jump"), function (form) {
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      var n = Math.round(Number(form.elements.page.value)), last = Number(body.dataset.pages);
      if (!(n >= 1 && n <= last)) return;
      var prefix = body.dataset.prefix;
      window.location.href = n === 1 ? prefix + ".html" : prefix + "-" + n + ".html";
    });
  });
})();
