from django.core.management.base import BaseCommand

from observability.diagnosis import report, snapshot
from platform_.redis import get_redis


class Command(BaseCommand):
    help = "Say which rows of the troubleshooting table hold now, with evidence and the suggested action."

    def add_arguments(self, parser):
        parser.add_argument("--window-s", type=int, default=60, help="how far back to look (default 60)")

    def handle(self, *args, **options):
        self.stdout.write(report(snapshot(get_redis(), window_s=options["window_s"])))
