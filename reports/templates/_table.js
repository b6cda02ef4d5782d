"use strict";
(function () {
  function cellKey(row, index) {
    var cell = row.cells[index];
    if (!cell) return "";
    var raw = cell.hasAttribute("data-sort") ? cell.getAttribute("data-sort") : cell.textContent.trim();
    var num = parseFloat(raw);
    return raw !== "" && !isNaN(num) && isFinite(raw) ? num : raw.toLowerCase();
  }
  function compare(a, b) {
    var an = typeof a === "number", bn = typeof b === "number";
    if (an && bn) return a - b;
    if (an !== bn) return an ? -1 : 1;
    return a < b ? -1 : a > b ? 1 : 0;
  }
  function sortBy(table, th) {
    var index = Array.prototype.indexOf.call(th.parentNode.children, th);
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (r1, r2) {
      var order = compare(cellKey(r1, index), cellKey(r2, index));
      return ascending ? order : -order;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  }
  function filter(table, input, counter) {
    var terms = input.value.toLowerCase().split(/\s+/).filter(Boolean);
    var shown = 0, rows = table.tBodies[0].rows;
    for (var i = 0; i < rows.length; i++) {
      var text = rows[i].textContent.toLowerCase();
      var keep = terms.every(function (t) { return text.indexOf(t) >= 0; });
      rows[i].hidden = !keep;
      if (keep) shown++;
    }
    if (counter) counter.textContent = shown + " of " + rows.length + " rows";
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.querySelectorAll("thead th").forEach(function (th) {
      th.addEventListener("click", function () { sortBy(table, th); });
    });
  });
  document.querySelectorAll("input[data-filter-for]").forEach(function (input) {
    var table = document.getElementById(input.getAttribute("data-filter-for"));
    var counter = document.querySelector("[data-count-for='" + table.id + "']");
    input.addEventListener("input", function () { filter(table, input, counter); });
    filter(table, input, counter);
  });
})();
