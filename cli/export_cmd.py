"""`dcptool export CAPTURE... -o FILE.pcapng`: a capture as TCP packets for Wireshark
(capture/pcap/export.py does the work)."""

from __future__ import annotations

import click


@click.command("export")
@click.argument("captures", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True),
              help="The packet file to write: pcapng, or pcap when it ends in .pcap.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Server port of every connection (default: the port of each row's node).")
@click.option("--mss", type=click.IntRange(64, 65000), default=16384, show_default=True,
              help="Largest TCP payload per packet; longer frames are split.")
def export_cmd(captures, output, port, mss):
    """Write captures as IPv4/TCP packets that Wireshark and tshark read.

    Each connection of the capture (`conn`) becomes one TCP connection from 127.0.0.1 to
    its server (the `node` column, or 127.0.0.1:--port), with a handshake, every frame or
    line in its direction at its `ts`, and a FIN at the end. For DCP on a port other
    than 11210 tell tshark: `-d tcp.port==PORT,couchbase`.

    \b
    Example:
      dcptool export ./captures -o session.pcapng && tshark -r session.pcapng
    """
    from dcptool.capture.pcap.export import export_pcap
    from dcptool.cli.exit_codes import error_line
    res = export_pcap(list(captures), output, port=port, mss=mss)
    click.echo(f"exported {res.frames:,} {'frames' if res.protocol == 'dcp' else 'lines'} of "
               f"{res.connections} connection(s) to {', '.join(res.servers) or '-'} as {res.packets:,} "
               f"packets in {output}", err=True)
    if res.frames == 0:
        error_line("warning: the captures hold no rows; the packet file is empty")
