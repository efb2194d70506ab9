// aici-batch report --html: unpack the data, then draw the run, the table, the lines the
// constraint bent most, the baseline and the plots.
(async function boot() {
  let data;
  try {
    data = await AB.loadData();
  } catch (error) {
    AB.fail(error);
    throw error;
  }
  AB.data = data;
  document.getElementById("title").textContent = "aici-batch report: " + data.title;
  AB.renderRun(data);
  AB.table = new AB.Table(data, (position) => AB.showLine(data, position));
  AB.renderBent(data);
  AB.renderBaseline(data);
  AB.renderPlots(data);
  AB.table.openFromHash();
  // The moment the table can be used: what bench/report_html.py measures.
  window.aiciReadyMs = performance.now();
  document.body.dataset.ready = "1";
})();
