"""The ``weight-checker`` command: :func:`weight_checker.cli.main.main`, its
files (:mod:`.files`) and its reports (:mod:`.report`)."""
