"""`dcptool import FILE.pcap|FILE.pcapng -o DIR`: a tcpdump file as captures
(capture/pcap/importer.py does the work)."""

from __future__ import annotations

import click


@click.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="Directory to write the capture to (Synapse beside DCP goes to DIR/synapse).")
@click.option("--port", "ports", type=click.IntRange(1, 65535), multiple=True,
              help="A server port that carries memcached/DCP besides 11210 (repeatable).")
@click.option("--compression", type=click.Choice(["zstd", "lz4", "snappy", "none"]), default="zstd",
              show_default=True, help="Parquet codec of the capture written (as `capture --compression`).")
def import_cmd(file, output, ports, compression):
    """Turn a packet capture (tcpdump's pcap or pcapng) into dcptool captures.

    Every TCP connection is reassembled in both directions (retransmitted, out-of-order
    and overlapping segments handled), its protocol found by port and content (DCP,
    Synapse replication lines, Synapse's Redis pub/sub), and its frames or lines written as a live capture
    would: packet times as `ts`, one `conn` per connection, `node` the server. TLS
    connections are skipped with one line each. Bytes the capture lost leave the frames
    around them as rows with `decode_error` and a warning (exit 0); a file that is not
    pcap/pcapng exits 2, one with nothing decodable 5.

    \b
    Example:
      tcpdump -i lo -w dcp.pcap port 11210 ... && dcptool import dcp.pcap -o ./imported
    """
    from dcptool.capture.pcap.importer import import_pcap
    from dcptool.cli.exit_codes import error_line

    def note(text: str) -> None:
        error_line(text) if text.startswith("warning") else click.echo(f"dcptool: {text}", err=True)

    res = import_pcap(file, output, ports=ports, note=note, compression=compression)
    for proto, rows in sorted(res.rows.items()):
        click.echo(f"imported {rows:,} {'frames' if proto == 'dcp' else 'lines'} of "
                   f"{res.connections.get(proto, 0)} {proto} connection(s) from {res.packets:,} packets "
                   f"into {res.outputs[proto]}", err=True)
    if res.gaps:
        error_line(f"warning: {res.gaps} hole(s) of {res.lost_bytes:,} bytes lost by the capture: "
                   f"{res.fragments} row(s) around them flagged with decode_error")
    elif res.fragments:
        error_line(f"warning: {res.fragments} row(s) flagged with decode_error (partial frames)")
    if res.truncated:
        error_line(f"warning: {file} is cut short inside a packet record; imported what came before")
