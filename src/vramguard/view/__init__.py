"""The views: every rich table, console and progress bar, the compare table and the HTML writer. The CLI,
the pytest plugins and the Trainer callback draw through here; nothing else imports rich (numbers come from
the core parts, orchestration stays in the faces)."""
