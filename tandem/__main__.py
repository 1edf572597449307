from tandem.cli import app

app(prog_name="tandem")
